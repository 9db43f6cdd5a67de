"""Autograd hooks that do not keep their owner alive, and leave the tensors with it
(:func:`weak_method` serves any callback held by what its owner holds: a context's ledger).

A DDP puts hooks on its module's parameters. Torch keeps a tensor's hooks out of the
cycle collector's sight, so a hook that holds its DDP (a closure over it, a bound method)
kept the DDP, its buckets and the module's gradients alive for as long as the module
lived, and its hooks stayed on the parameters: a DDP made later on the same module (a
retry loop that wraps it again) ran the dropped one's hooks in its own backward pass,
with the dropped one's reductions and failures. PyTorch's reducer removes its hooks when
it is freed; so do these, once their owner is collected.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["collect_dropped", "owned_by", "weak_method"]

#: the owners of hooks not collected yet.
_OWNERS: weakref.WeakSet[Any] = weakref.WeakSet()


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """A hook calling the bound ``method`` while its object lives, else doing nothing
    (and returning None: a tensor hook then leaves the gradient as it is)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def hook(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return hook


def owned_by(owner: Any, handles: Iterable[Any]) -> None:
    """``handles`` (of hooks that hold ``owner`` weakly) are removed when ``owner`` is
    collected; until then a new owner may collect it (:func:`collect_dropped`)."""
    _OWNERS.add(owner)
    weakref.finalize(owner, _remove, list(handles))


def collect_dropped() -> None:
    """Before a new owner hooks tensors: when owners of hooks exist in this process, those
    only kept by reference cycles (dropped by the user, not collected yet) are collected
    now, so that their hooks leave, and their finalizers run, before the new hooks do.
    An owner still referenced keeps its hooks (both then run, as two PyTorch DDPs on one
    module do). A process whose first DDP this is pays nothing."""
    if _OWNERS:
        gc.collect()


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
