"""A pass's plan for the engine: dependency counts and priorities, cached on the graph.

Computing the dependencies of a pass and converting them to Python lists costs more
than a small graph's pass; a training loop runs the same graph (the torch backend keeps
one graph object per structure) from the same roots and sends on every pass, so the plan
is kept on the immutable graph and reused.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from xgrad.dependencies import compute_dependencies, reaching
from xgrad.graph import BackwardGraph, NodeKind

__all__ = ["PEER_FIRST", "Plan", "lists", "plan", "reaches_recv"]


@dataclass(frozen=True)
class Plan:
    """What a pass needs from the dependency computation, as Python data (read-only).

    Attributes:
        counts: dependency count per node (the pass copies it and counts down).
        needed: whether the pass executes each node.
        reached_recvs: the reached recv nodes (each must be linked to a send).
        ready: the heap of the priorities of the roots ready at the start.
    """

    counts: tuple[int, ...]
    needed: tuple[bool, ...]
    reached_recvs: tuple[int, ...]
    ready: tuple[int, ...]


#: Plans kept per graph (one per roots/sends/outputs); past this the graph's plans are
#: dropped and recomputed. A graph is immutable, so a plan is never stale for it.
_PLANS_PER_GRAPH = 16


def plan(
    graph: BackwardGraph,
    roots: Iterable[int],
    sends: Iterable[int],
    outputs: Iterable[int] | None,
) -> Plan:
    """The dependencies of a pass from ``roots`` and ``sends``, cached on the graph.

    A training loop runs the same graph (the torch backend keeps one graph object per
    structure) from the same roots and sends on every pass; computing the dependencies
    and converting them to Python lists again each time costs more than a small graph's
    pass. The plan depends only on the graph, the roots, the sends, the outputs and the
    order (``PEER_FIRST``), which make the key; a computation that raises is not cached,
    so it raises again.
    """
    root_t, send_t = tuple(roots), tuple(sends)
    out_t = None if outputs is None else tuple(outputs)
    try:
        # the ready roots' priorities depend on the order in force (PEER_FIRST)
        key: Any = (root_t, send_t, out_t, PEER_FIRST)
        hash(key)
    except TypeError:  # unhashable ids: compute_dependencies names them
        key = None
    plans: dict[Any, Plan] = graph._cache.setdefault("engine_plans", {})
    found = plans.get(key) if key is not None else None
    if found is not None:
        return found
    deps = compute_dependencies(graph, root_t, send_t, outputs=out_t)
    reached_recvs = np.flatnonzero(deps.reachable & (graph.kinds == NodeKind.RECV)).tolist()
    counts = deps.counts.tolist()
    needed = deps.needed.tolist()
    prio = lists(graph)[-1]
    ready = [prio[u] for u in deps.roots if counts[u] == 0 and needed[u]]
    heapq.heapify(ready)
    made = Plan(tuple(counts), tuple(needed), tuple(reached_recvs), tuple(ready))
    if key is not None:
        if len(plans) >= _PLANS_PER_GRAPH:
            plans.clear()
        plans[key] = made
    return made


def reaches_recv(graph: BackwardGraph) -> list[bool]:
    """Per node: whether a path from it leads to a recv node, a gradient another worker
    waits for (cached on the immutable graph)."""
    found = graph._cache.get("reaches_recv")
    if found is None:
        found = reaching(graph, graph.nodes_of_kind(NodeKind.RECV).tolist()).tolist()
        graph._cache["reaches_recv"] = found
    return found  # type: ignore[no-any-return]


#: whether, among ready nodes, those leading to a recv go before the recvs themselves
#: (see :func:`lists`); False: by creation only, as a local pass always is.
PEER_FIRST = True


def lists(graph: BackwardGraph) -> tuple[list[int], ...]:
    """The graph's arrays as Python lists (cached on the immutable graph), and each node's
    priority in the ready heap.

    Python ints, not numpy scalars, in the per-node loop: comparing a numpy integer with a
    NodeKind costs microseconds, and a small graph's pass is mostly this loop. The heap is
    a min-heap of ``-priority``, in tiers, later-created nodes first within a tier:
    accumulators (cheap; as autograd's AccumulateGrad, whose sequence number is the
    largest); nodes from which a recv is reached; the recvs (each sends its gradient to
    the worker waiting for it); the rest (work for this worker's leaves only). So a
    gradient ready to go waits while work toward another recv is ready: a send costs its
    sender 50-200 µs, and the peer behind the longer computation gets its gradient that
    much sooner. On ``bench dist-autograd`` the last rank of the chain then answers the
    next rank before the first one (which can use that gradient only once the chain's
    comes back): 0.90-1.02 of the time of a pass in A/B (median 0.93). A local pass has no
    recv, so its order is autograd's, as before.
    """
    key = f"engine_lists_{PEER_FIRST}"
    found = graph._cache.get(key)
    if found is None:
        kinds = graph.kinds.tolist()
        n = len(kinds)
        acc = int(NodeKind.ACCUMULATE)
        recv = int(NodeKind.RECV)
        if PEER_FIRST and recv in kinds:
            peer = reaches_recv(graph)
            tiers = [
                3 if k == acc else 1 if k == recv else 2 if peer[u] else 0
                for u, k in enumerate(kinds)
            ]
        else:
            tiers = [3 if k == acc else 0 for k in kinds]
        prio = [-(u + t * n) for u, t in enumerate(tiers)]
        found = (
            kinds,
            graph.num_inputs().tolist(),
            graph.indptr.tolist(),
            graph.dst.tolist(),
            graph.input_nr.tolist(),
            graph.params.tolist(),
            prio,
        )
        graph._cache[key] = found
    return found  # type: ignore[no-any-return]
