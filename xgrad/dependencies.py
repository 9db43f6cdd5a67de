"""The dependency computation of distributed autograd, on a :class:`~xgrad.graph.BackwardGraph`.

A backward graph is walked breadth-first from its roots *and* from every ``send`` node of a
distributed context; each node's dependency count is the number of edges into it from
reachable nodes; leaves are gradient accumulators or ``recv`` nodes; given the outputs that
are wanted, only the nodes on a path to them are marked as needed (``recv`` nodes always
are). Parameters whose accumulator is not reached are unused (DDP's
``find_unused_parameters``). The graph itself, as data, is :mod:`xgrad.graph`.

>>> from xgrad.graph import GraphBuilder
>>> b = GraphBuilder()
>>> loss, w = b.add_node("function", "MseBackward"), b.add_node("accumulate", "w", param=0)
>>> b.add_edge(loss, w)
>>> compute_dependencies(b.build(), roots=[loss]).table()
{0: 0, 1: 1}
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from xgrad.graph import BackwardGraph, BoolArray, IntArray, NodeKind

__all__ = [
    "Dependencies",
    "compute_dependencies",
    "reachable_from",
    "reaching",
    "unused_parameters",
]


@dataclass(frozen=True, eq=False)
class Dependencies:
    """The result of :func:`compute_dependencies` (all arrays read-only, indexed by node).

    Attributes:
        roots, sends: the node ids the walk started from.
        reachable: ``(n,)`` bool, nodes reached from the roots and sends (these included).
        counts: ``(n,)`` int64, edges into each node from reachable nodes (0 if unreachable).
        leaves: sorted node ids of the reachable accumulators and ``recv`` nodes.
        needed: ``(n,)`` bool, reachable nodes on a path to a wanted output or to a ``recv``
            node (outputs and recvs included): the nodes a backward pass executes.
    """

    roots: tuple[int, ...]
    sends: tuple[int, ...]
    reachable: Any
    counts: Any
    leaves: Any
    needed: Any

    def table(self) -> dict[int, int]:
        """``{node: dependency count}`` for every reachable node."""
        nodes = np.flatnonzero(self.reachable)
        return dict(zip(nodes.tolist(), self.counts[nodes].tolist(), strict=True))

    def needed_nodes(self) -> list[int]:
        return np.flatnonzero(self.needed).tolist()  # type: ignore[no-any-return]


def _check_nodes(graph: BackwardGraph, nodes: Iterable[int], what: str) -> tuple[int, ...]:
    out = tuple(int(u) for u in nodes)
    n = graph.num_nodes
    for u in out:
        if not 0 <= u < n:
            raise ValueError(f"{what} contains {u}, which is not a node id (0..{n - 1})")
    return out


def _reach_scipy(indptr: IntArray, dst: IntArray, n: int, seeds: IntArray) -> BoolArray:
    """Nodes reachable from ``seeds``: one C-speed BFS from a virtual node pointing at them."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import breadth_first_order

    indices = np.concatenate([dst, seeds]).astype(np.int32, copy=False)
    ptr = np.concatenate([indptr, [indptr[-1] + seeds.size]]).astype(np.int32, copy=False)
    data = np.ones(indices.size, dtype=np.int8)
    mat = csr_matrix((data, indices, ptr), shape=(n + 1, n + 1))
    order = breadth_first_order(mat, n, directed=True, return_predecessors=False)
    mask = np.zeros(n + 1, dtype=bool)
    mask[order] = True
    return mask[:n]


def _reach_python(indptr: IntArray, dst: IntArray, n: int, seeds: IntArray) -> BoolArray:
    """The same walk in plain Python (linear time; used when scipy is not installed)."""
    ptr = indptr.tolist()
    nxt = dst.tolist()
    seen = bytearray(n)
    queue: deque[int] = deque()
    for s in seeds.tolist():
        if not seen[s]:
            seen[s] = 1
            queue.append(s)
    while queue:
        u = queue.popleft()
        for v in nxt[ptr[u] : ptr[u + 1]]:
            if not seen[v]:
                seen[v] = 1
                queue.append(v)
    return np.frombuffer(bytes(seen), dtype=np.uint8).astype(bool)


_SMALL = 2048


def _reach(indptr: IntArray, dst: IntArray, n: int, seeds: IntArray) -> BoolArray:
    if seeds.size == 0:
        return np.zeros(n, dtype=bool)
    # int32 indices keep scipy's walk cheap; beyond that fall back to the Python walk.
    # Below a few thousand nodes and edges the Python walk is faster than building
    # scipy's matrix (microseconds against a few hundred: a distributed backward walks
    # each rank's small graph on every pass).
    if _SMALL < n + dst.size < 2**31 - 2 - seeds.size:
        try:
            return _reach_scipy(indptr, dst, n, seeds)
        except ImportError:
            pass
    return _reach_python(indptr, dst, n, seeds)


def _reverse_csr(graph: BackwardGraph) -> tuple[IntArray, IntArray]:
    """Edges by destination: ``(indptr, src)`` of the transposed graph (cached)."""
    if "reverse" not in graph._cache:
        order = np.argsort(graph.dst, kind="stable")
        rptr = np.zeros(graph.num_nodes + 1, dtype=np.int64)
        np.cumsum(np.bincount(graph.dst, minlength=graph.num_nodes), out=rptr[1:])
        graph._cache["reverse"] = (rptr, graph.src[order])
    return graph._cache["reverse"]  # type: ignore[no-any-return]


def reachable_from(graph: BackwardGraph, seeds: Iterable[int]) -> BoolArray:
    """``(n,)`` bool: nodes reachable from ``seeds`` (seeds included), in linear time."""
    s = np.asarray(_check_nodes(graph, seeds, "seeds"), dtype=np.int64)
    return _reach(graph.indptr, graph.dst, graph.num_nodes, np.unique(s))


def reaching(graph: BackwardGraph, targets: Iterable[int]) -> BoolArray:
    """``(n,)`` bool: nodes from which one of ``targets`` is reachable (targets included),
    in linear time: the walk of :func:`reachable_from` on the reversed edges."""
    t = np.asarray(_check_nodes(graph, targets, "targets"), dtype=np.int64)
    rptr, rsrc = _reverse_csr(graph)
    return _reach(rptr, rsrc, graph.num_nodes, np.unique(t))


def compute_dependencies(
    graph: BackwardGraph,
    roots: Iterable[int],
    sends: Iterable[int] = (),
    *,
    outputs: Iterable[int] | None = None,
) -> Dependencies:
    """Dependency counts, leaves and needed nodes, as PyTorch's distributed autograd engine.

    This follows ``DistEngine::computeDependencies``: the graph is walked breadth-first from
    the roots *and* from every ``send`` node of the distributed context (a gradient can
    arrive there from another worker even when no local root leads to it). A node's
    dependency count is the number of edges into it from reached nodes, so the engine runs
    it once all of them have delivered. The walk's leaves must be accumulators or ``recv``
    nodes. PyTorch's artificial ``GraphRoot`` is not a node here: its edges to the roots are
    not counted; an engine seeds the roots' gradients itself.

    ``needed`` says what a pass executes: every reached node on a path to a wanted output
    (default: all leaves). ``recv`` nodes are always needed, with their ancestors, because
    the worker on the other side waits for the gradient they send back.

    Args:
        graph: the backward graph.
        roots: node ids whose gradient the caller provides (the outputs' ``grad_fn``).
        sends: ``send`` node ids of the distributed context (each must be of kind SEND).
        outputs: the wanted outputs (node ids); default all leaves found.

    Raises:
        ValueError: on a node id out of range, a ``sends`` entry that is not a send node, or
            a reached node without outgoing edges that is neither an accumulator nor a recv.

    Runs in O(nodes + edges): one breadth-first walk forward and one backward.
    """
    root_t = _check_nodes(graph, roots, "roots")
    send_t = _check_nodes(graph, sends, "sends")
    for u in send_t:
        if graph.kinds[u] != NodeKind.SEND:
            raise ValueError(f"sends contains node {u} ({graph.name(u)!r}), not a send node")
    out_t = None if outputs is None else _check_nodes(graph, outputs, "outputs")
    small = graph.num_nodes + graph.num_edges <= _SMALL
    walk = _dependencies_lists if small else _dependencies_arrays
    reachable, counts, leaves, needed = walk(graph, root_t + send_t, out_t)
    for a in (reachable, counts, leaves, needed):
        a.setflags(write=False)
    return Dependencies(
        roots=root_t, sends=send_t, reachable=reachable, counts=counts, leaves=leaves, needed=needed
    )


def _bad_leaf(graph: BackwardGraph, u: int) -> ValueError:
    return ValueError(
        f"node {u} ({graph.name(u)!r}, kind {graph.kind(u).name.lower()}) is reached but "
        "has no outgoing edges; only accumulators and recv nodes may be leaves"
    )


def _dependencies_arrays(
    graph: BackwardGraph, seeds_t: tuple[int, ...], out_t: tuple[int, ...] | None
) -> tuple[Any, Any, Any, Any]:
    """The computation with whole-array operations (graphs of thousands of nodes)."""
    n = graph.num_nodes
    seeds = np.unique(np.asarray(seeds_t, dtype=np.int64))
    reachable = _reach(graph.indptr, graph.dst, n, seeds)
    src = graph.src
    counts = np.bincount(graph.dst[reachable[src]], minlength=n).astype(np.int64)
    outdeg = np.diff(graph.indptr)
    kinds = graph.kinds
    ends = np.flatnonzero(reachable & (outdeg == 0) & (kinds != NodeKind.SEND))
    bad = ends[(kinds[ends] != NodeKind.ACCUMULATE) & (kinds[ends] != NodeKind.RECV)]
    if bad.size:
        raise _bad_leaf(graph, int(bad[0]))
    leaves = ends.astype(np.int64)
    wanted = leaves if out_t is None else np.asarray(out_t, dtype=np.int64)
    recvs = np.flatnonzero(reachable & (kinds == NodeKind.RECV))
    targets = np.unique(np.concatenate([wanted, recvs]).astype(np.int64))
    rptr, rsrc = _reverse_csr(graph)
    needed = reachable & _reach(rptr, rsrc, n, targets)
    return reachable, counts, leaves, needed


def _lists(graph: BackwardGraph) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """``indptr, dst, kinds`` and the reverse CSR as Python lists (cached on the graph)."""
    if "lists" not in graph._cache:
        rptr, rsrc = _reverse_csr(graph)
        graph._cache["lists"] = (
            graph.indptr.tolist(),
            graph.dst.tolist(),
            graph.kinds.tolist(),
            rptr.tolist(),
            rsrc.tolist(),
        )
    return graph._cache["lists"]  # type: ignore[no-any-return]


def _walk(ptr: list[int], nxt: list[int], seen: list[bool], seeds: Iterable[int]) -> None:
    stack = [s for s in seeds if not seen[s]]
    for s in stack:
        seen[s] = True
    while stack:
        u = stack.pop()
        for v in nxt[ptr[u] : ptr[u + 1]]:
            if not seen[v]:
                seen[v] = True
                stack.append(v)


def _dependencies_lists(
    graph: BackwardGraph, seeds_t: tuple[int, ...], out_t: tuple[int, ...] | None
) -> tuple[Any, Any, Any, Any]:
    """The same computation on Python lists: a small graph's numpy calls cost more than the
    walk itself (a distributed backward computes each rank's small graph on every pass)."""
    indptr, dst, kinds, rptr, rsrc = _lists(graph)
    n = len(kinds)
    reach = [False] * n
    _walk(indptr, dst, reach, seeds_t)
    counts = [0] * n
    leaves = []
    send, acc, recv = int(NodeKind.SEND), int(NodeKind.ACCUMULATE), int(NodeKind.RECV)
    for u in range(n):
        if not reach[u]:
            continue
        lo, hi = indptr[u], indptr[u + 1]
        for v in dst[lo:hi]:
            counts[v] += 1
        if lo == hi and kinds[u] != send:
            if kinds[u] != acc and kinds[u] != recv:
                raise _bad_leaf(graph, u)
            leaves.append(u)
    wanted = leaves if out_t is None else list(out_t)
    targets = wanted + [u for u in range(n) if reach[u] and kinds[u] == recv]
    back = [False] * n
    _walk(rptr, rsrc, back, targets)
    needed = [r and b for r, b in zip(reach, back, strict=True)]
    return (
        np.array(reach, dtype=bool),
        np.array(counts, dtype=np.int64),
        np.array(leaves, dtype=np.int64),
        np.array(needed, dtype=bool),
    )


def unused_parameters(
    graph: BackwardGraph,
    roots: Iterable[int],
    sends: Iterable[int] = (),
    *,
    num_params: int | None = None,
) -> tuple[int, ...]:
    """Parameter indices whose accumulator is not reachable from the outputs (sorted).

    This is DDP's search for unused parameters (``find_unused_parameters=True``): walk the
    graph from the outputs' backward nodes; a parameter whose accumulator is never reached
    gets no gradient this iteration and must be marked ready by hand. With ``num_params``,
    parameters that have no accumulator in the graph at all are unused too.
    """
    reach = reachable_from(graph, tuple(roots) + tuple(sends))
    acc = graph.params >= 0
    missing = graph.params[acc & ~reach]
    if num_params is not None:
        present = np.zeros(num_params, dtype=bool)
        in_range = graph.params[acc]
        if in_range.size and int(in_range.max()) >= num_params:
            raise ValueError(
                f"num_params={num_params} but the graph has parameter {int(in_range.max())}"
            )
        present[in_range] = True
        missing = np.concatenate([missing, np.flatnonzero(~present)])
    return tuple(sorted(int(p) for p in np.unique(missing)))
