"""One rank's backward pass executed by torch's own engine, in waves, on xgrad's dependencies.

xgrad's dependency computation decides what a pass does: from the roots and every send
(``compute_dependencies`` on the ``grad_fn`` graph, :mod:`.dist_graph`) it knows which
recvs are needed, which outputs (the roots together, each send) reach which recv and
which leaf, and so when a recv's (a leaf's) gradient is complete: when every output
reaching it was processed (:mod:`.dist_wave_plan`). The local graph itself runs in torch's C++ engine, in waves:
whenever outputs' gradients are available (the roots at the start, the sends' gradients
as they land, with any others already landed), the recvs completed by them get their
gradients from one ``torch.autograd.grad`` call over every output reaching them, sent
back at once in the order the recvs were received; then the leaves completed get theirs
in a second call. By linearity, each recv and leaf computed once from all its outputs
gives the exact sums. Measured on ``bench dist-autograd`` this is as fast as xgrad's node
engine (waves/nodes 0.95-1.06), which stays the default (``dist_autograd.EXECUTE``).

A failing wave is run once more under anomaly mode, whose report names the failing
node, so the error says ``"Error on rank R in <Node>: ..."`` as the node engine does.
Leaves with tensor hooks are not run here (their hooks must see the summed gradient once),
nor nodes with hooks seen registered in the context (:mod:`.dist_hooks`; the same), nor
reentrant checkpoints (which torch runs only under ``backward``): :func:`run_pass`
gives those passes to xgrad's node engine. A received tensor's hooks run
where torch's engine captures its gradient, once, on the sum.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from torch.autograd.graph import GradientEdge

from xgrad.dependencies import reachable_from
from xgrad.engine import BackwardError, Engine
from xgrad.engine import DistBackwardError as _EngineDistBackwardError
from xgrad.engine_worker import run_worker_part
from xgrad.torch_backend.dist_accumulate import leaf_hooks
from xgrad.torch_backend.dist_graph import RankGraph
from xgrad.torch_backend.dist_pass import ProcessPass
from xgrad.torch_backend.dist_release import one_recompute
from xgrad.torch_backend.dist_wave_plan import WavePlan, plan_waves

__all__ = ["WavePlan", "plan_waves", "run_pass", "run_waves"]


_NODE = re.compile(r"Error detected in ([^\s.]+)")


def _grad(outputs: list[Any], inputs: list[Any], grads: list[Any]) -> Sequence[Any]:
    return torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)


def _named(outputs: list[Any], inputs: list[Any], grads: list[Any]) -> str:
    """The failing node's name: the wave once more, under anomaly mode, which reports it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.set_detect_anomaly(True, check_nan=False):
                _grad(outputs, inputs, grads)
        except Exception:
            pass
    for w in caught:
        found = _NODE.search(str(w.message))
        if found:
            return found.group(1).rsplit("::", 1)[-1]
    return "backward"


#: one output of a wave: its node, its tensors (several for the roots; a send's edge, taken
#: when it was sent), their gradients.
Item = tuple[int, Sequence[Any], Sequence[Any]]


class _Waves:
    """The state of one pass: the outputs processed so far, what each recv and leaf waits for.

    A recv's (a leaf's) gradient is computed once, when every output reaching it was
    processed, in one call from all of those outputs: no node runs twice for one input,
    and the engine sums where paths meet, as a single backward would.
    """

    def __init__(
        self,
        pass_: ProcessPass,
        me: int,
        rank_graph: RankGraph,
        plan: WavePlan,
        recvs: Sequence[tuple[torch.Tensor, Any]],
        accumulate: Any,
    ) -> None:
        self.pass_ = pass_
        self.me = me
        self.plan = plan
        self.recv_index = rank_graph.recv_nodes
        # Each recv's gradient is taken where it leaves its node (the tensor may have been
        # changed in place since, which moved its grad_fn on).
        self.recv_edge = {r: GradientEdge(recvs[i][1], 0) for r, i in self.recv_index.items()}
        self.leaf = rank_graph.leaves
        self.accumulate = accumulate
        self.recv_waits = dict(plan.recv_waits)
        self.leaf_waits = dict(plan.leaf_waits)
        self.done: dict[int, tuple[list[Any], list[Any]]] = {}  # output -> its live tensors
        self.grads: dict[int, Any] = {}

    def call(self, outs: list[Any], grads: list[Any], inputs: list[Any]) -> Sequence[Any]:
        try:
            return _grad(outs, inputs, grads)
        except _EngineDistBackwardError:
            raise
        except Exception as exc:
            node = _named(outs, inputs, grads)
            raise BackwardError(-1, node, f"{type(exc).__name__}: {exc}", self.me) from exc

    def _from(
        self, reach: dict[int, tuple[int, ...]], wanted: list[int]
    ) -> tuple[list[Any], list[Any]]:
        """The processed outputs' tensors and gradients that reach any of ``wanted``."""
        want = set(wanted)
        outs: list[Any] = []
        gs: list[Any] = []
        for node, (tensors, grads) in self.done.items():
            if tensors and not want.isdisjoint(reach[node]):
                outs += tensors
                gs += grads
        return outs, gs

    def wave(self, items: Sequence[Item]) -> None:
        """Process these outputs, each exactly once (a None gradient adds nothing)."""
        plan = self.plan
        recvs: list[int] = []
        leaves: list[int] = []
        for node, tensors, grads in items:
            live = [(t, g) for t, g in zip(tensors, grads, strict=True) if g is not None]
            self.done[node] = ([t for t, _ in live], [g for _, g in live])
            for r in plan.recvs[node]:
                self.recv_waits[r] -= 1
                if self.recv_waits[r] == 0:
                    recvs.append(r)
            for p in plan.leaves[node]:
                self.leaf_waits[p] -= 1
                if self.leaf_waits[p] == 0:
                    leaves.append(p)
        if recvs:
            # The recvs first: their senders wait for these gradients, the leaves do not;
            # answered in the order they were received (a chain's next rank first).
            recvs.sort(key=self.recv_index.__getitem__)
            outs, gs = self._from(plan.recvs, recvs)
            got: Sequence[Any] = [None] * len(recvs)
            if outs:
                got = self.call(outs, gs, [self.recv_edge[r] for r in recvs])
            for r, g in zip(recvs, got, strict=True):  # the engine ran the recv's hooks
                self.pass_.deliver(self.me, r, g, hooked=True)
        if leaves:
            leaves.sort()
            outs, gs = self._from(plan.leaves, leaves)
            if outs:
                got = self.call(outs, gs, [self.leaf[p] for p in leaves])
                for p, g in zip(leaves, got, strict=True):
                    if g is not None:
                        self.grads[p] = self.accumulate(self.grads.get(p), g)


def run_waves(
    pass_: ProcessPass,
    me: int,
    rank_graph: RankGraph,
    roots: Sequence[torch.Tensor],
    send_edges: Sequence[GradientEdge],
    recvs: Sequence[tuple[torch.Tensor, Any]],
    accumulate: Any,
) -> dict[int, Any]:
    """Run this rank's part of the pass; returns leaf index -> summed gradient.

    The caller posts failures and finishes the pass as for the node engine
    (``Engine.backward_distributed``): this raises :class:`BackwardError` naming the node.
    """
    root = next(iter(rank_graph.grad_roots), None)
    sends = rank_graph.send_nodes
    plan = plan_waves(rank_graph.graph, root, sends)
    state = _Waves(pass_, me, rank_graph, plan, recvs, accumulate)
    edge_of = dict(zip(sends, send_edges, strict=True))
    if root is not None:  # the roots are one output (GraphRoot), seeded with ones
        state.wave([(root, roots, [torch.ones_like(r) for r in roots])])
    pending = set(sends)
    while pending:
        landed = [pass_.receive(me), *pass_.receive_landed(me)]
        pass_.raise_if_failed(me)
        pending.difference_update(u for u, _ in landed)
        state.wave([(u, (edge_of[u],), (g,)) for u, g in landed])
    return state.grads


def hooked(rank_graph: RankGraph) -> bool:
    """Whether a leaf has tensor hooks (they must see the sum once). A received tensor's
    run where its gradient is captured, once, on the sum (:meth:`_Waves.wave`)."""
    return any(t._backward_hooks for t in rank_graph.leaves)


#: nodes torch's engine refuses to run under ``torch.autograd.grad`` (a wave's call):
#: reentrant checkpointing (``use_reentrant=True``) runs only under ``backward``.
_NODES_ONLY = frozenset({"CheckpointFunctionBackward"})


def nodes_only(rank_graph: RankGraph) -> bool:
    """Whether the rank's graph has a node only xgrad's node engine can run."""
    return not _NODES_ONLY.isdisjoint(rank_graph.graph.names)


def run_pass(
    execute: str,
    pass_: ProcessPass,
    me: int,
    rank_graph: RankGraph,
    roots: Sequence[torch.Tensor],
    send_edges: Sequence[GradientEdge],
    recvs: Sequence[tuple[torch.Tensor, Any]],
    accumulate: Any,
) -> tuple[dict[int, Any], list[int]]:
    """This rank's pass on ``execute`` ("nodes": xgrad's engine; "waves": torch's engine).

    Returns leaf index -> summed gradient, and the graph's nodes the pass surely ran (the
    node engine's, in order; with waves, those under the roots: a send's part runs only
    when its gradient came, which its peer may not have sent). A pass whose leaves have
    tensor hooks runs on
    the node engine, which calls them once on the summed gradient, and so do one whose
    other nodes have hooks seen registered in the context (``inner_hooks``) and one through
    a reentrant checkpoint (:func:`nodes_only`).
    """
    if execute not in ("nodes", "waves"):  # failed as a pass, so no peer waits for this rank
        try:
            message = f"ValueError: dist_autograd.EXECUTE={execute!r} must be 'nodes' or 'waves'"
            raise pass_.fail(me, -1, "backward", message)
        finally:
            pass_.release(me)
    if (
        execute == "waves"
        and not hooked(rank_graph)
        and not rank_graph.inner_hooks
        and not nodes_only(rank_graph)
    ):
        # Ended as ``Engine.backward_distributed`` ends a pass: every rank raises the first
        # failure posted (named by rank and node); the pass is finished (every rank done,
        # every send received) or released (poison what is owed).
        grads = run_worker_part(
            pass_,
            me,
            lambda: run_waves(pass_, me, rank_graph, roots, send_edges, recvs, accumulate),
        )
        return grads, under_roots(rank_graph)
    engine = Engine(accumulate=accumulate)
    for i, leaf in enumerate(rank_graph.leaves):
        node_hooks = rank_graph.leaf_node_hooks.get(i)
        if leaf._backward_hooks or node_hooks is not None:
            engine.register_post_accumulate_hook(i, leaf_hooks(engine, leaf, node_hooks))
    # A non-reentrant checkpoint recomputes once per pass (dist_release); torch's engine
    # (waves) does not take one group: its calls overlap where a wave resumes.
    with torch.no_grad(), one_recompute():
        engine.backward_distributed(
            cast(Any, pass_), me, rank_graph.graph, rank_graph.functions, rank_graph.grad_roots
        )
    return engine.grads, rank_graph.ran


def under_roots(rank_graph: RankGraph) -> list[int]:
    """The nodes reached from the roots' node (none without roots)."""
    reached = reachable_from(rank_graph.graph, rank_graph.grad_roots)
    return [int(u) for u in np.flatnonzero(reached)]
