"""Which recvs and leaves each output of a rank's pass reaches: the plan of its waves.

From xgrad's dependency computation on the rank's graph (the roots together as one output,
each send as another), :func:`plan_waves` finds, through the needed nodes, the recvs and
the leaves each output reaches and how many outputs reach each: a recv's (a leaf's)
gradient is complete once that many were processed. Kept apart from the waves
(:mod:`.dist_waves`, which runs them on torch's engine and re-exports these names)
because the plan is frozen data computed from the graph alone, no tensor in it, and
cached per graph structure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xgrad.dependencies import compute_dependencies
from xgrad.graph import BackwardGraph, NodeKind

__all__ = ["WavePlan", "plan_waves"]


@dataclass(frozen=True)
class WavePlan:
    """Which recvs and leaves each output reaches (frozen; cached per graph structure).

    Attributes:
        recvs: output node -> the recv nodes it reaches, through needed nodes.
        leaves: output node -> the accumulators' leaf indices it reaches.
        recv_waits: recv node -> how many outputs reach it (its gradient is complete when
            they were all processed).
        leaf_waits: leaf index -> how many outputs reach it.
    """

    recvs: dict[int, tuple[int, ...]]
    leaves: dict[int, tuple[int, ...]]
    recv_waits: dict[int, int]
    leaf_waits: dict[int, int]


_PLANS: dict[int, tuple[BackwardGraph, WavePlan]] = {}
_PLANS_MAX = 64


def plan_waves(graph: BackwardGraph, root: int | None, sends: Sequence[int]) -> WavePlan:
    """The plan of ``graph`` from ``root`` (the GraphRoot node, or None) and ``sends``."""
    cached = _PLANS.get(id(graph))
    if cached is not None and cached[0] is graph:
        return cached[1]
    roots = () if root is None else (root,)
    deps = compute_dependencies(graph, roots, sends)
    needed = deps.needed.tolist()
    kinds = graph.kinds.tolist()
    params = graph.params.tolist()
    indptr = graph.indptr.tolist()
    dst = graph.dst.tolist()
    recvs: dict[int, tuple[int, ...]] = {}
    leaves: dict[int, tuple[int, ...]] = {}
    recv_waits: dict[int, int] = {}
    leaf_waits: dict[int, int] = {}
    for out in (*roots, *sends):
        seen = {out}
        stack = [out]
        found_recvs: list[int] = []
        found_leaves: list[int] = []
        while stack:
            u = stack.pop()
            if kinds[u] == NodeKind.RECV:
                found_recvs.append(u)
                recv_waits[u] = recv_waits.get(u, 0) + 1
            elif kinds[u] == NodeKind.ACCUMULATE:
                found_leaves.append(params[u])
                leaf_waits[params[u]] = leaf_waits.get(params[u], 0) + 1
            for e in range(indptr[u], indptr[u + 1]):
                v = dst[e]
                if needed[v] and v not in seen:
                    seen.add(v)
                    stack.append(v)
        recvs[out] = tuple(sorted(found_recvs))
        leaves[out] = tuple(sorted(found_leaves))
    plan = WavePlan(recvs, leaves, recv_waits, leaf_waits)
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[id(graph)] = (graph, plan)
    return plan
