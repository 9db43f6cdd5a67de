"""A rank's own exception, raised as the step's :class:`~xgrad.failure.RankError` and as itself.

When a step fails, every rank raises a :class:`~xgrad.failure.RankError` naming where the
failure started. On a rank whose own code raised (a ``ValueError`` in the module's
forward, a ``KeyError`` in a comm hook), a plain ``RankError`` (a ``RuntimeError``) would
no longer be caught by the ``except ValueError:`` that catches it under PyTorch's DDP or
pipelining, which raise the exception as it is. So that rank raises an instance of both:
a class made from the error's class and the exception's, named ``RankError[ValueError]``;
``except ValueError``, ``except RankError`` and ``except RuntimeError`` all catch it,
and the original is its ``__cause__``. Where no such class can be made (exception types
whose instances are laid out differently, such as ``OSError``), the plain error is kept.
Backend-neutral: used by the torch backend's DDP and pipeline runtime.
"""

from __future__ import annotations

from typing import Any

from xgrad.failure import Failure, RankError

__all__ = ["as_local"]


def as_local(error: RankError, cause: BaseException) -> RankError:
    """``error``, also an instance of ``cause``'s type when ``cause`` is this rank's own
    exception (see the module docstring); ``error`` itself otherwise."""
    if isinstance(cause, RankError) or not isinstance(cause, Exception):
        return error
    mixed = _mixed(type(error), type(cause))
    if mixed is None:
        return error
    return mixed(error.failure, error.raised_on, error.prefix, error.also)


#: the classes made so far, per (error class, exception class): one class per pair.
_MADE: dict[tuple[type, type], type[RankError] | None] = {}


def _mixed(error_type: type[RankError], cause_type: type[Exception]) -> type[RankError] | None:
    key = (error_type, cause_type)
    if key not in _MADE:
        _MADE[key] = _make(error_type, cause_type)
    return _MADE[key]


def _make(error_type: type[RankError], cause_type: type[Exception]) -> type[RankError] | None:
    if issubclass(error_type, cause_type):
        return None  # already caught as one (a RuntimeError, an Exception)
    namespace: dict[str, Any] = {
        "__module__": error_type.__module__,
        "__qualname__": f"{error_type.__qualname__}[{cause_type.__qualname__}]",
        "__str__": BaseException.__str__,  # not KeyError's repr of the message
        "__reduce__": _reduce,
    }
    try:
        made = type(
            f"{error_type.__name__}[{cause_type.__name__}]", (error_type, cause_type), namespace
        )
    except TypeError:  # instances laid out differently (OSError, ...): cannot be both
        return None
    return made


def _reduce(self: RankError) -> tuple[Any, ...]:
    # Picklable (a launcher sends it to the parent) where both classes can be found by name.
    error_type, cause_type = type(self).__bases__
    return _rebuild, (error_type, cause_type, self.failure, self.raised_on, self.prefix, self.also)


def _rebuild(
    error_type: type[RankError],
    cause_type: type[Exception],
    failure: Failure,
    raised_on: int | None,
    prefix: str,
    also: tuple[Failure, ...],
) -> RankError:
    mixed = _mixed(error_type, cause_type)
    cls = error_type if mixed is None else mixed
    return cls(failure, raised_on, prefix, also)
