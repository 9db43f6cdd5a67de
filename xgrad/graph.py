"""A backward graph as frozen data, and the dependency computation of distributed autograd.

A backward graph has one node per backward function and one edge per gradient that flows
from a node to the next one, exactly like the ``next_edges`` of PyTorch's autograd nodes:
edge ``k`` leaving node ``u`` carries ``u``'s ``k``-th output gradient into input number
``input_nr`` of its destination. Nodes are of four kinds (:class:`NodeKind`): ordinary
functions, gradient accumulators of parameters (leaves, with the parameter's index), and
the ``send`` / ``recv`` nodes that RPC leaves in a distributed autograd context.

Edges are stored in compressed sparse rows (numpy arrays), so a million-node graph costs a
few arrays and is walked in linear time. Two ways to make one:

>>> b = GraphBuilder()
>>> loss = b.add_node("function", "MseBackward")
>>> mm = b.add_node("function", "MmBackward")
>>> w = b.add_node("accumulate", "w", param=0)
>>> b.add_edge(loss, mm)
>>> b.add_edge(mm, w)
>>> g = b.build()
>>> deps = compute_dependencies(g, roots=[loss])
>>> deps.table()
{0: 0, 1: 1, 2: 1}

or, for big graphs made by a program (a jaxpr walk, a benchmark), directly from arrays with
:meth:`BackwardGraph.from_arrays`.
"""

from __future__ import annotations

import enum
import json
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class NodeKind(enum.IntEnum):
    """What a node does in the backward pass."""

    FUNCTION = 0  # an ordinary backward function: gradients in, gradients out
    ACCUMULATE = 1  # a parameter's gradient accumulator (a leaf; has a parameter index)
    SEND = 2  # where a tensor was sent to another worker: its gradient comes back here
    RECV = 3  # where a tensor was received: its gradient is sent back to the sender (a leaf)

    @classmethod
    def parse(cls, kind: NodeKind | str | int) -> NodeKind:
        """Accept a :class:`NodeKind`, its lower-case name (``"accumulate"``) or its value."""
        if isinstance(kind, str):
            try:
                return cls[kind.upper()]
            except KeyError:
                raise ValueError(
                    f"kind={kind!r} is not a node kind; expected one of "
                    f"{[k.name.lower() for k in cls]}"
                ) from None
        try:
            return cls(int(kind))
        except ValueError:
            raise ValueError(f"kind={kind!r} is not a node kind (0..{len(cls) - 1})") from None


def _frozen(a: npt.ArrayLike, dtype: type) -> Any:
    out: Any = np.array(a, dtype=dtype, copy=True).reshape(-1)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class BackwardGraph:
    """A backward graph: node arrays plus edges in compressed sparse rows (by source node).

    Attributes:
        kinds: ``(n,)`` int8, a :class:`NodeKind` per node.
        params: ``(n,)`` int64, the parameter index of an accumulator, -1 for other nodes.
        names: ``n`` labels, for messages and printing only (may repeat, may be empty).
        indptr: ``(n + 1,)`` int64; node ``u``'s edges are ``indptr[u]:indptr[u + 1]``, in
            output order (edge ``k`` of ``u`` carries ``u``'s ``k``-th output gradient).
        dst: ``(E,)`` int64, the destination node of each edge.
        input_nr: ``(E,)`` int64, which input of the destination the edge feeds.

    All arrays are read-only; build one with :class:`GraphBuilder` or :meth:`from_arrays`.
    """

    kinds: Any
    params: Any
    names: tuple[str, ...]
    indptr: Any
    dst: Any
    input_nr: Any
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_arrays(
        cls,
        kinds: npt.ArrayLike,
        src: npt.ArrayLike,
        dst: npt.ArrayLike,
        *,
        input_nr: npt.ArrayLike | None = None,
        params: npt.ArrayLike | None = None,
        names: Sequence[str] | None = None,
    ) -> BackwardGraph:
        """Build a graph from flat arrays (vectorised; the way to make big graphs).

        Args:
            kinds: one :class:`NodeKind` value per node.
            src, dst: one entry per edge. Edges keep their given order within a source node
                (a stable sort), which is the order of that node's outputs.
            input_nr: input number per edge (default 0 everywhere).
            params: parameter index per node, -1 for non-accumulators (default: accumulators
                numbered 0, 1, ... in node order).
            names: a label per node (default none: :meth:`name` then shows the kind).

        Raises:
            ValueError: on out-of-range node ids, unknown kinds, an accumulator without a
                parameter index (or a parameter with two accumulators), or an accumulator or
                ``recv`` node with outgoing edges (both are leaves).
        """
        kind_arr = np.asarray(kinds, dtype=np.int64).reshape(-1)
        n = int(kind_arr.size)
        bad_kind = np.flatnonzero((kind_arr < 0) | (kind_arr >= len(NodeKind)))
        if bad_kind.size:
            u = int(bad_kind[0])
            raise ValueError(f"kinds[{u}]={int(kind_arr[u])} is not a NodeKind value")
        src_arr = np.asarray(src, dtype=np.int64).reshape(-1)
        dst_arr = np.asarray(dst, dtype=np.int64).reshape(-1)
        if src_arr.shape != dst_arr.shape:
            raise ValueError(f"src has {src_arr.size} edges but dst has {dst_arr.size}")
        nr_arr = (
            np.zeros_like(src_arr)
            if input_nr is None
            else np.asarray(input_nr, dtype=np.int64).reshape(-1)
        )
        if nr_arr.shape != src_arr.shape:
            raise ValueError(f"input_nr has {nr_arr.size} entries, expected {src_arr.size}")
        for label, arr in (("src", src_arr), ("dst", dst_arr)):
            bad = np.flatnonzero((arr < 0) | (arr >= n))
            if bad.size:
                e = int(bad[0])
                raise ValueError(f"{label}[{e}]={int(arr[e])} is not a node id (0..{n - 1})")
        bad = np.flatnonzero(nr_arr < 0)
        if bad.size:
            raise ValueError(f"input_nr[{int(bad[0])}]={int(nr_arr[bad[0]])} must be >= 0")
        is_acc = kind_arr == NodeKind.ACCUMULATE
        if params is None:
            param_arr = np.full(n, -1, dtype=np.int64)
            param_arr[is_acc] = np.arange(int(is_acc.sum()), dtype=np.int64)
        else:
            param_arr = np.asarray(params, dtype=np.int64).reshape(-1)
            if param_arr.size != n:
                raise ValueError(f"params has {param_arr.size} entries, expected {n} (one a node)")
        wrong = np.flatnonzero(is_acc != (param_arr >= 0))
        if wrong.size:
            u = int(wrong[0])
            raise ValueError(
                f"node {u} (kind {NodeKind(kind_arr[u]).name.lower()}) has param="
                f"{int(param_arr[u])}: accumulators need a parameter index >= 0, other nodes -1"
            )
        acc_params = np.sort(param_arr[is_acc])
        dup = np.flatnonzero(acc_params[1:] == acc_params[:-1])
        if dup.size:
            raise ValueError(f"parameter {int(acc_params[dup[0]])} has two accumulator nodes")
        counts = np.bincount(src_arr, minlength=n)
        leafy = np.flatnonzero(
            (counts > 0) & ((kind_arr == NodeKind.ACCUMULATE) | (kind_arr == NodeKind.RECV))
        )
        if leafy.size:
            u = int(leafy[0])
            raise ValueError(
                f"node {u} is a {NodeKind(kind_arr[u]).name.lower()} node with "
                f"{int(counts[u])} outgoing edges; accumulators and recvs are leaves"
            )
        order = np.argsort(src_arr, kind="stable")
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        if names is None:
            name_tuple: tuple[str, ...] = ()
        else:
            name_tuple = tuple(str(s) for s in names)
            if len(name_tuple) != n:
                raise ValueError(f"names has {len(name_tuple)} entries, expected {n}")
            if not any(name_tuple):
                name_tuple = ()  # all empty is the same as none
        graph = cls(
            kinds=_frozen(kind_arr, np.int8),
            params=_frozen(param_arr, np.int64),
            names=name_tuple,
            indptr=_frozen(indptr, np.int64),
            dst=_frozen(dst_arr[order], np.int64),
            input_nr=_frozen(nr_arr[order], np.int64),
        )
        src_sorted = src_arr[order]
        src_sorted.setflags(write=False)
        graph._cache["src"] = src_sorted
        return graph

    @property
    def num_nodes(self) -> int:
        return int(self.kinds.size)

    @property
    def num_edges(self) -> int:
        return int(self.dst.size)

    @property
    def src(self) -> IntArray:
        """``(E,)`` source node of every edge (aligned with :attr:`dst`)."""
        if "src" not in self._cache:
            s = np.repeat(np.arange(self.num_nodes, dtype=np.int64), np.diff(self.indptr))
            s.setflags(write=False)
            self._cache["src"] = s
        return self._cache["src"]  # type: ignore[no-any-return]

    def name(self, node: int) -> str:
        """The node's label, or its kind (and parameter) when it has none."""
        if self.names and self.names[node]:
            return self.names[node]
        kind = NodeKind(int(self.kinds[node]))
        if kind is NodeKind.ACCUMULATE:
            return f"accumulate[{int(self.params[node])}]"
        return f"{kind.name.lower()}#{node}"

    def kind(self, node: int) -> NodeKind:
        return NodeKind(int(self.kinds[node]))

    def next_edges(self, node: int) -> list[tuple[int, int]]:
        """``[(dst, input_nr), ...]`` leaving ``node``, in output order."""
        lo, hi = int(self.indptr[node]), int(self.indptr[node + 1])
        return list(zip(self.dst[lo:hi].tolist(), self.input_nr[lo:hi].tolist(), strict=True))

    def num_inputs(self) -> IntArray:
        """``(n,)`` number of inputs per node: one more than the largest incoming input_nr."""
        if "num_inputs" not in self._cache:
            out = np.zeros(self.num_nodes, dtype=np.int64)
            np.maximum.at(out, self.dst, self.input_nr + 1)
            out.setflags(write=False)
            self._cache["num_inputs"] = out
        return self._cache["num_inputs"]  # type: ignore[no-any-return]

    def accumulator(self, param: int) -> int:
        """The node id of parameter ``param``'s accumulator (ValueError if it has none)."""
        hit = np.flatnonzero(self.params == param)
        if hit.size == 0:
            raise ValueError(f"param={param} has no accumulator node in this graph")
        return int(hit[0])

    def nodes_of_kind(self, kind: NodeKind | str) -> IntArray:
        return np.flatnonzero(self.kinds == NodeKind.parse(kind)).astype(np.int64)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (small graphs: printing, saving, comparing)."""
        return {
            "nodes": [
                {"kind": self.kind(u).name.lower(), "name": self.names[u] if self.names else ""}
                | ({"param": int(self.params[u])} if self.params[u] >= 0 else {})
                for u in range(self.num_nodes)
            ],
            "edges": [
                [int(s), int(d), int(k)]
                for s, d, k in zip(
                    self.src.tolist(), self.dst.tolist(), self.input_nr.tolist(), strict=True
                )
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BackwardGraph:
        """The inverse of :meth:`to_dict` (validated like :meth:`from_arrays`)."""
        try:
            nodes, edges = data["nodes"], data["edges"]
            kinds = [int(NodeKind.parse(nd["kind"])) for nd in nodes]
            params = [int(nd.get("param", -1)) for nd in nodes]
            names = [str(nd.get("name", "")) for nd in nodes]
            src, dst, nr = ([int(e[i]) for e in edges] for i in range(3))
        except (KeyError, TypeError, IndexError) as err:
            raise ValueError(
                f"not a BackwardGraph description ({err!r}): {str(data)[:80]}"
            ) from None
        return cls.from_arrays(kinds, src, dst, input_nr=nr, params=params, names=names)

    @classmethod
    def from_json(cls, text: str) -> BackwardGraph:
        return cls.from_dict(json.loads(text))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BackwardGraph):
            return NotImplemented
        return self.names == other.names and all(
            np.array_equal(getattr(self, a), getattr(other, a))
            for a in ("kinds", "params", "indptr", "dst", "input_nr")
        )

    __hash__ = None  # type: ignore[assignment]


class GraphBuilder:
    """Builds a :class:`BackwardGraph` one node and edge at a time.

    Node ids are handed out in order 0, 1, 2, ... The engine runs ready nodes with higher
    ids first (like autograd's sequence numbers), so add nodes in forward order: a later
    operation gets a higher id and its backward runs earlier.

    Edges leaving a node are numbered in the order they are added: the ``k``-th
    ``add_edge(u, ...)`` carries ``u``'s ``k``-th output gradient.
    """

    def __init__(self) -> None:
        self._kinds: list[int] = []
        self._params: list[int] = []
        self._names: list[str] = []
        self._src: list[int] = []
        self._dst: list[int] = []
        self._nr: list[int] = []

    def add_node(self, kind: NodeKind | str, name: str = "", param: int | None = None) -> int:
        """Add a node and return its id.

        Args:
            kind: ``"function"``, ``"accumulate"``, ``"send"``, ``"recv"`` or a NodeKind.
            name: a label for messages (e.g. ``"AddmmBackward0"`` or ``"layers.0.weight"``).
            param: the parameter index; required for accumulators, refused for the others.
        """
        k = NodeKind.parse(kind)
        if (k is NodeKind.ACCUMULATE) != (param is not None):
            raise ValueError(
                f"add_node(kind={k.name.lower()!r}, name={name!r}, param={param!r}): "
                "accumulators need param=<index>, other kinds take none"
            )
        if param is not None and (not isinstance(param, int) or param < 0):
            raise ValueError(f"param={param!r} must be an int >= 0 (node {name!r})")
        self._kinds.append(int(k))
        self._params.append(-1 if param is None else param)
        self._names.append(name)
        return len(self._kinds) - 1

    def add_edge(self, src: int, dst: int, input_nr: int = 0) -> None:
        """Gradient flows from ``src``'s next output into input ``input_nr`` of ``dst``."""
        n = len(self._kinds)
        for label, u in (("src", src), ("dst", dst)):
            if not 0 <= u < n:
                raise ValueError(f"add_edge: {label}={u} is not a node id (0..{n - 1})")
        if input_nr < 0:
            raise ValueError(f"add_edge({src}, {dst}): input_nr={input_nr} must be >= 0")
        self._src.append(src)
        self._dst.append(dst)
        self._nr.append(input_nr)

    @property
    def num_nodes(self) -> int:
        return len(self._kinds)

    def build(self) -> BackwardGraph:
        """Freeze into a :class:`BackwardGraph` (the builder stays usable)."""
        return BackwardGraph.from_arrays(
            self._kinds,
            self._src,
            self._dst,
            input_nr=self._nr,
            params=self._params,
            names=self._names,
        )


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


def _reach(indptr: IntArray, dst: IntArray, n: int, seeds: IntArray) -> BoolArray:
    if seeds.size == 0:
        return np.zeros(n, dtype=bool)
    # int32 indices keep scipy's walk cheap; beyond that fall back to the Python walk.
    if n + 1 + dst.size + seeds.size < 2**31 - 1:
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
    n = graph.num_nodes
    seeds = np.unique(np.asarray(root_t + send_t, dtype=np.int64))
    reachable = _reach(graph.indptr, graph.dst, n, seeds)
    src = graph.src
    counts = np.bincount(graph.dst[reachable[src]], minlength=n).astype(np.int64)
    outdeg = np.diff(graph.indptr)
    kinds = graph.kinds
    ends = np.flatnonzero(reachable & (outdeg == 0) & (kinds != NodeKind.SEND))
    bad = ends[(kinds[ends] != NodeKind.ACCUMULATE) & (kinds[ends] != NodeKind.RECV)]
    if bad.size:
        u = int(bad[0])
        raise ValueError(
            f"node {u} ({graph.name(u)!r}, kind {graph.kind(u).name.lower()}) is reached but "
            "has no outgoing edges; only accumulators and recv nodes may be leaves"
        )
    leaves = ends.astype(np.int64)
    if outputs is None:
        wanted = leaves
    else:
        wanted = np.asarray(_check_nodes(graph, outputs, "outputs"), dtype=np.int64)
    recvs = np.flatnonzero(reachable & (kinds == NodeKind.RECV))
    targets = np.unique(np.concatenate([wanted, recvs]).astype(np.int64))
    rptr, rsrc = _reverse_csr(graph)
    needed = reachable & _reach(rptr, rsrc, n, targets)
    for a in (reachable, counts, leaves, needed):
        a.setflags(write=False)
    return Dependencies(
        roots=root_t, sends=send_t, reachable=reachable, counts=counts, leaves=leaves, needed=needed
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
