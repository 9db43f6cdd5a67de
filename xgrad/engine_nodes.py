"""What a backend hands the engine to call: node functions, their deferred parts, hooks.

A backend describes a backward pass as a graph (:mod:`xgrad.graph`) and, per function
node, a :data:`NodeFunction` (the reference backend's numpy models, the torch backend's
calls of its ``grad_fn`` nodes); a node function may leave some of its edges' gradients
for later with a :class:`Deferred`, and a :data:`PostAccumulateHook` learns of each
accumulated gradient (the reducer's ``mark_ready``). Kept apart from the engine
(:mod:`xgrad.engine`, which re-exports these) so that writing them needs none of its
workings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Deferred", "NodeFunction", "PostAccumulateHook"]

#: A node's backward: one gradient per input (None where none arrived) -> one per next edge
#: (None: no gradient along that edge).
NodeFunction = Callable[[list[Any]], Sequence[Any]]
#: Called after a parameter's gradient was accumulated: ``hook(param_index, accumulated)``;
#: the reducer's ``mark_ready`` has exactly this signature.
PostAccumulateHook = Callable[[int, Any], None]


class Deferred:
    """Gradients of some of a node's edges, computed later: when no node is ready.

    A node function may put one Deferred at the places of several of its next edges;
    ``compute()`` then returns their gradients in the order of those places. The engine
    calls it once nothing else is ready (before waiting for a message, and before the pass
    ends), so what other workers wait for goes first and the rest (a weight's gradient,
    say) after, as zero-bubble pipeline schedules split a backward into B and W.
    """

    __slots__ = ("compute",)

    def __init__(self, compute: Callable[[], Sequence[Any]]) -> None:
        self.compute = compute
