"""The arguments of the pipeline runtime's ``step`` and ``eval``, taken as torch's
schedules take them.

``torch.distributed.pipelining``'s ``schedule.step(*args, target=None, losses=None,
**kwargs)`` and ``schedule.eval`` name the targets ``target``; the runtime's
``step(inputs, targets, *, losses)`` named them ``targets`` alone, so a torch user's
``runtime.step(x, target=y, losses=losses)`` raised a ``TypeError``. Either name is taken,
one at a time. Kept apart from :mod:`~xgrad.torch_backend.pipeline`, which holds the
event loop.
"""

from __future__ import annotations

from typing import Any

__all__ = ["step_arguments"]


def step_arguments(method: str, targets: Any, target: Any, losses: Any) -> Any:
    """The targets of a call of ``method`` (``"step"``, ``"eval"``), given as ``targets``
    or as torch's ``target``, with ``losses`` checked.

    ``None`` is no targets, as torch's default; both given is a ``TypeError`` naming both,
    as Python's own for an argument given twice (one of them would be dropped unseen).

    Raises:
        TypeError: both ``targets`` and ``target`` given, or ``losses`` not a list.
    """
    if losses is not None and not isinstance(losses, list):
        raise TypeError(f"losses must be a list, got a {type(losses).__name__}")
    if target is None:
        return targets
    if targets is not None:
        raise TypeError(
            f"PipelineRuntime.{method}() got multiple values for argument 'targets': "
            "targets and target= (torch's name for it); give one"
        )
    return target
