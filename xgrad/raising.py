"""Raising the error made for a caught exception, without a reference cycle.

The usual form, ``error = make(exc); raise error from exc`` in an ``except`` block, leaves
``error`` in a local of a frame on ``error``'s own traceback: a cycle, which keeps the
exception, its traceback and every frame on it (their tensors, the autograd graph behind
them) until the garbage collector runs. When ``make`` hands back ``exc`` itself (already
the step's error), ``raise exc from exc`` makes it its own cause, a cycle too.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["raise_from"]


def raise_from(error: BaseException, cause: BaseException) -> NoReturn:
    """Raise ``error`` from ``cause``; ``cause`` as it is when the two are one.

    Give it the error as made (``raise_from(make(exc), exc)``), not from a local of the
    caller: this frame drops its references as it leaves, so no frame on the traceback
    holds the exception.

    Example:
        >>> try:
        ...     try:
        ...         {}["k"]
        ...     except KeyError as exc:
        ...         raise_from(ValueError("no k"), exc)
        ... except ValueError as err:
        ...     print(repr(err.__cause__))
        KeyError('k')
    """
    try:
        if error is cause:
            raise error
        raise error from cause
    finally:
        del error, cause
