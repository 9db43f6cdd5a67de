"""One rank's part of a distributed backward pass: the torch ``grad_fn`` graph as xgrad data.

The walk starts from a ``GraphRoot`` node (one edge per root tensor, as PyTorch's engine
seeds a backward) and from one ``send`` node per tensor this rank sent that requires grad
(its edge, taken at the ``send``, leads to the sent tensor's ``grad_fn`` then, or to its
accumulator for a leaf). A received tensor's ``RecvBackward`` node (:mod:`.dist_edges`)
becomes a ``recv`` node; the accumulators of every leaf, parameters and inputs alike, are
numbered in discovery order. The node functions call the torch nodes themselves
(:mod:`.dist_nodes`), so xgrad's engine runs the pass with its own dependency counts; a
matrix product whose input's gradient goes to a peer computes that one first and defers
its weights' (:mod:`.dist_split`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, get_gradient_edge

from xgrad.engine import NodeFunction
from xgrad.engine_plan import lists, reaches_recv
from xgrad.graph import BackwardGraph, NodeKind
from xgrad.torch_backend import dist_split
from xgrad.torch_backend.dist_edges import hooked_caller, may_have_hooks
from xgrad.torch_backend.dist_hooks import Seen, probe
from xgrad.torch_backend.dist_nodes import node_caller, recorded, root_function
from xgrad.torch_backend.dist_split import SPLITTABLE

__all__ = ["RankGraph", "build_rank_graph"]

_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


@dataclass(frozen=True)
class RankGraph:
    """What the engine needs for one rank's pass.

    Attributes:
        graph: the backward graph (node 0 is ``GraphRoot`` when there are roots).
        functions: node id -> backward function, for every torch function node.
        grad_roots: ``{GraphRoot: seed}`` (empty without roots).
        leaves: accumulator ``params`` index -> the leaf tensor it accumulates for.
        send_nodes: the node of each send, in the order of ``sends``.
        recv_nodes: recv node -> its index in ``recvs``.
        inner_hooks: whether some node has hooks seen registered in the context
            (:mod:`.dist_hooks`): they run once on the node engine, and torch's (waves)
            would run them once per call through the node.
        leaf_node_hooks: leaf index -> the pre- and post-hook dicts of its accumulator,
            where the context saw C++ node hooks registered and the leaf has some.
        walked: node id -> its torch function node (of those a pass ran, a pass without
            ``retain_graph`` frees the saved tensors, :mod:`.dist_release`).
        ran: the function nodes the node engine ran with a gradient, as it ran them (a
            send whose peer sent no gradient back leaves its part unrun, as torch's
            engine does, and a local ``backward`` through it later still works).
    """

    graph: BackwardGraph
    functions: dict[int, NodeFunction]
    grad_roots: dict[int, Any]
    leaves: tuple[torch.Tensor, ...]
    send_nodes: tuple[int, ...]
    recv_nodes: dict[int, int]
    inner_hooks: bool = False
    leaf_node_hooks: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    walked: dict[int, Any] = field(default_factory=dict)
    ran: list[int] = field(default_factory=list)


#: graphs by structure: a training loop walks a new torch graph of the same shape on
#: every pass, and building (validating) a BackwardGraph costs more than walking it.
_GRAPHS: dict[tuple[tuple[Any, ...], ...], BackwardGraph] = {}
_GRAPHS_MAX = 64


def _graph(*arrays: list[Any]) -> BackwardGraph:
    """The BackwardGraph of these arrays; the same (immutable) object for the same structure."""
    key = tuple(tuple(a) for a in arrays)
    graph = _GRAPHS.get(key)
    if graph is None:
        kinds, src, dst, input_nr, params, names = arrays
        graph = BackwardGraph.from_arrays(
            kinds, src, dst, input_nr=input_nr, params=params, names=names
        )
        if len(_GRAPHS) >= _GRAPHS_MAX:
            _GRAPHS.clear()
        _GRAPHS[key] = graph
    return graph


def _split(
    graph: BackwardGraph,
    products: list[tuple[int, Any, list[int], list[Any]]],
    functions: dict[int, NodeFunction],
) -> None:
    """Matrix products whose input's gradient goes to a peer compute it first (:mod:`.dist_split`)."""
    to_peer = reaches_recv(graph)
    indptr, dst = lists(graph)[2:4]
    for u, fn, keep, wants in products:
        first = [to_peer[dst[e]] for e in range(indptr[u], indptr[u + 1])]
        split = dist_split.split_caller(fn, keep, wants, first, functions[u])
        if split is not None:
            functions[u] = split


def build_rank_graph(
    roots: Sequence[torch.Tensor],
    sends: Sequence[tuple[torch.Tensor | GradientEdge, str]],
    recvs: Sequence[tuple[Any, str]],
    hooked: Sequence[Any] = (),
    seen: Seen | None = None,
) -> RankGraph:
    """The graph from ``roots`` and the ``(tensor or edge, label)`` sends; the ``(node,
    label)`` recvs become recv nodes.

    A send's edge is the one taken when it was sent, so an in-place op on the tensor
    afterwards does not move where its gradient enters. A recv is the received tensor's
    ``RecvBackward`` node (:func:`.dist_edges.received`). The torch nodes in ``hooked``
    (those of sent tensors that may have hooks), those of roots that may have some and
    those ``seen`` given tensor hooks in the context run the hooks on their inputs first
    (:func:`.dist_edges.hooked_caller`); the Python Functions ``seen`` given hooks or told
    not to materialize gradients get them (:func:`.dist_nodes.node_caller`).

    Raises:
        ValueError: a root that does not require grad or is not a scalar.
    """
    for i, r in enumerate(roots):
        if not isinstance(r, torch.Tensor):
            raise TypeError(f"roots[{i}] is a {type(r).__name__}, not a tensor")
        if not r.requires_grad:
            raise ValueError(f"roots[{i}] does not require grad; nothing to differentiate")
        if r.numel() != 1:
            raise ValueError(
                f"roots[{i}] has shape {tuple(r.shape)}; roots must be scalars (one element)"
            )
    recv_index = {id(node): i for i, (node, _) in enumerate(recvs)}
    kinds: list[int] = []
    params: list[int] = []
    names: list[str] = []
    src: list[int] = []
    dst: list[int] = []
    input_nr: list[int] = []
    ids: dict[int, int] = {}
    keep_alive: list[Any] = []  # ids of freed nodes could be reused during the walk
    stack: list[tuple[int, Any]] = []
    leaves: list[torch.Tensor] = []
    recv_nodes: dict[int, int] = {}
    functions: dict[int, NodeFunction] = {}
    # C++ nodes got hooks in the context, but which is not known: each is asked.
    probing = seen is not None and seen.cpp_node_hooks
    leaf_node_hooks: dict[int, tuple[Any, Any]] = {}

    def add(kind: NodeKind, name: str, param: int = -1) -> int:
        kinds.append(int(kind))
        params.append(param)
        names.append(name)
        return len(kinds) - 1

    def node_of(fn: Any) -> int:
        found = ids.get(id(fn))
        if found is not None:
            return found
        keep_alive.append(fn)
        if id(fn) in recv_index:
            u = add(NodeKind.RECV, recvs[recv_index[id(fn)]][1])
            recv_nodes[u] = recv_index[id(fn)]
        elif type(fn) is _ACCUMULATE_GRAD:
            u = add(NodeKind.ACCUMULATE, "AccumulateGrad", len(leaves))
            if probing:
                dicts = probe(fn)
                if dicts != (None, None):
                    leaf_node_hooks[len(leaves)] = dicts
            leaves.append(fn.variable)
        else:
            u = add(NodeKind.FUNCTION, type(fn).__name__)
            stack.append((u, fn))
        ids[id(fn)] = u
        return u

    def edge(u: int, fn: Any, nr: int) -> None:
        src.append(u)
        dst.append(node_of(fn))
        input_nr.append(nr)

    grad_roots: dict[int, Any] = {}
    if roots:
        root = add(NodeKind.FUNCTION, "GraphRoot")
        functions[root] = root_function(roots)
        grad_roots[root] = torch.ones(())
        for r in roots:
            e = get_gradient_edge(r)
            edge(root, e.node, e.output_nr)
    send_nodes = []
    for t, label in sends:
        u = add(NodeKind.SEND, label)
        e = t if isinstance(t, GradientEdge) else get_gradient_edge(t)
        edge(u, e.node, e.output_nr)
        send_nodes.append(u)
    products: list[tuple[int, Any, list[int], list[Any]]] = []  # see dist_split
    probed = False
    walked: dict[int, Any] = {}
    while stack:
        u, fn = stack.pop()
        walked[u] = fn
        keep = []
        wants = []
        for i, (child, nr) in enumerate(fn.next_functions):
            if child is not None:
                keep.append(i)
                wants.append(child._input_metadata[nr])
                edge(u, child, nr)
        if seen is not None and isinstance(fn, BackwardCFunction):
            entry = seen.node_hooks.get(id(fn))
            hooks = None if entry is None else (entry[1], entry[2])
            functions[u] = node_caller(fn, keep, wants, hooks, id(fn) not in seen.unmaterialized)
        elif probing and (found := probe(fn)) != (None, None):
            functions[u] = node_caller(fn, keep, wants, found)
            probed = True
        else:
            functions[u] = node_caller(fn, keep, wants)
        if len(keep) > 1 and names[u] in SPLITTABLE:
            products.append((u, fn, keep, wants))
    graph = _graph(kinds, src, dst, input_nr, params, names)
    if products and recv_nodes and dist_split.SPLIT:
        _split(graph, products, functions)
    hooked = [*hooked, *(r.grad_fn for r in roots if may_have_hooks(r, r.grad_fn))]
    inner = probed or bool(leaf_node_hooks)
    if seen is not None:
        inner = inner or any(key in ids for key in seen.node_hooks)  # live nodes' ids
        for node in seen.hooked_nodes():
            inner = inner or id(node) in ids
            hooked.append(node)
    # Once per node: a tensor sent twice, or sent and a root, or two outputs of one node.
    wrapped = {ids.get(id(node), -1): node for node in hooked}
    for u, node in wrapped.items():
        if u >= 0 and kinds[u] == NodeKind.FUNCTION and names[u] != "GraphRoot":
            functions[u] = hooked_caller(node, functions[u])
    ran: list[int] = []
    for u in walked:
        functions[u] = recorded(functions[u], u, ran)
    return RankGraph(
        graph, functions, grad_roots, tuple(leaves), tuple(send_nodes), recv_nodes, inner,
        leaf_node_hooks, walked, ran,
    )  # fmt: skip
