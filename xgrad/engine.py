"""Runs a backward graph: a ready queue driven by dependency counts, hooks, errors.

The engine is array-agnostic: node functions receive and return arrays of any library
(numpy in the reference backend) and the engine only adds them where edges meet.

A local pass::

    engine = Engine()
    engine.register_post_accumulate_hook(0, reducer.mark_ready)
    result = engine.backward(graph, functions, {loss_node: ones})

A distributed pass (:class:`~xgrad.dist_context.DistContext`, re-exported here with the
errors of :mod:`xgrad.engine_errors`) runs one engine per worker; ``recv`` nodes send
their gradient back to the matching ``send`` node of another worker. The first error on
any worker stops the pass on every worker, each raising :class:`DistBackwardError` naming
the worker it came from, and the context is released everywhere so the next pass works
(:func:`~xgrad.engine_worker.run_worker_part`, re-exported here).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xgrad.dist_context import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from xgrad.dist_context import DistContext as DistContext
from xgrad.engine_errors import BackwardError as BackwardError
from xgrad.engine_errors import DistBackwardError as DistBackwardError
from xgrad.engine_nodes import Deferred as Deferred
from xgrad.engine_nodes import NodeFunction as NodeFunction
from xgrad.engine_nodes import PostAccumulateHook as PostAccumulateHook
from xgrad.engine_plan import lists
from xgrad.engine_plan import plan as make_plan
from xgrad.engine_worker import mark_node, node_error
from xgrad.engine_worker import run_worker_part as run_worker_part
from xgrad.graph import BackwardGraph, NodeKind


@dataclass(frozen=True)
class PassResult:
    """What a finished pass did: the nodes in the order they ran, and its context id."""

    order: tuple[int, ...]
    context_id: int | None = None


def _default_accumulate(old: Any, new: Any) -> Any:
    # Like AccumulateGrad: keep a private copy first, then add in place (numpy) or rebind
    # (immutable arrays such as JAX's, for which ``+=`` makes a new array).
    if old is None:
        return new.copy() if hasattr(new, "copy") else new
    old += new
    return old


class Engine:
    """Executes backward graphs and accumulates parameter gradients (one engine per worker).

    Args:
        accumulate: ``accumulate(old_or_None, new) -> accumulated``; the default copies the
            first gradient and then adds in place, like autograd's AccumulateGrad.
        add: how two gradients arriving at the same input are summed.

    Attributes:
        grads: accumulated gradient per parameter index (what ``.grad`` is in torch); the
            reducer writes reduced gradients back here. Clear with :meth:`zero_grad`.
        contexts: ids of the distributed passes this engine is taking part in right now.
    """

    def __init__(
        self,
        *,
        accumulate: Callable[[Any, Any], Any] = _default_accumulate,
        add: Callable[[Any, Any], Any] = lambda a, b: a + b,
    ) -> None:
        self._accumulate = accumulate
        self._add = add
        self.grads: dict[int, Any] = {}
        self._hooks: dict[int, dict[int, PostAccumulateHook]] = {}
        self._hook_ids = itertools.count()
        self.contexts: set[int] = set()
        self._lock = threading.Lock()

    def register_post_accumulate_hook(
        self, param: int, hook: PostAccumulateHook
    ) -> Callable[[], None]:
        """Call ``hook(param, grad)`` after each accumulation into ``param``; returns a remover."""
        key = next(self._hook_ids)
        self._hooks.setdefault(param, {})[key] = hook

        def remove() -> None:
            self._hooks.get(param, {}).pop(key, None)

        return remove

    def zero_grad(self) -> None:
        self.grads.clear()

    def backward(
        self,
        graph: BackwardGraph,
        functions: Mapping[int, NodeFunction],
        grad_roots: Mapping[int, Any],
        *,
        outputs: Iterable[int] | None = None,
    ) -> PassResult:
        """Run one local backward pass.

        Args:
            graph: the backward graph.
            functions: the backward function of every function node that will run (send
                nodes default to passing their gradient on). A node that receives no
                gradient at all (every input None) is not called: None flows on. An
                accumulator that receives none adds nothing, but its hooks still run with
                the gradient accumulated so far, as autograd's post hooks do. A function
                may return a :class:`Deferred` for some edges.
            grad_roots: ``{root node: gradient for its input 0}``.
            outputs: wanted outputs (see :func:`~xgrad.graph.compute_dependencies`).

        Raises:
            BackwardError: the first node that failed (its id, name and message); nothing of
                the pass is kept, so the next pass starts clean. Gradients accumulated before
                the failure stay in :attr:`grads`, as they do in autograd.
        """
        return PassResult(self._run(graph, functions, grad_roots, outputs, None, None))

    def backward_distributed(
        self,
        ctx: DistContext,
        worker: int,
        graph: BackwardGraph,
        functions: Mapping[int, NodeFunction],
        grad_roots: Mapping[int, Any] | None = None,
    ) -> PassResult:
        """Run this worker's part of a distributed pass (call once per worker, in its thread).

        Returns when every worker of ``ctx`` finished; raises :class:`DistBackwardError` on
        every worker if any failed. The context is released either way.
        """
        if worker not in ctx.workers:
            raise ValueError(f"worker={worker} is not one of the context's workers {ctx.workers}")
        with self._lock:
            self.contexts.add(ctx.context_id)
        try:
            order = run_worker_part(
                ctx,
                worker,
                lambda: self._run(graph, functions, grad_roots or {}, None, ctx, worker),
            )
            return PassResult(order, ctx.context_id)
        finally:
            with self._lock:
                self.contexts.discard(ctx.context_id)

    def _run(
        self,
        graph: BackwardGraph,
        functions: Mapping[int, NodeFunction],
        grad_roots: Mapping[int, Any],
        outputs: Iterable[int] | None,
        ctx: DistContext | None,
        worker: int | None,
    ) -> tuple[int, ...]:
        sends = ctx.sends_of(worker) if ctx is not None and worker is not None else ()
        plan = make_plan(graph, grad_roots.keys(), sends, outputs)
        recvs_here = ctx.recvs_of(worker) if ctx is not None and worker is not None else {}
        for r in plan.reached_recvs:
            if r not in recvs_here:
                raise ValueError(
                    f"recv node {r} ({graph.name(r)!r}) is reached but not linked to a send "
                    "node of a distributed context"
                )
        counts = list(plan.counts)
        needed = plan.needed
        kinds, n_in, indptr, dst, input_nr, params, prio = lists(graph)
        n = graph.num_nodes
        buffers: dict[int, list[Any]] = {}

        def buffer(u: int) -> list[Any]:
            if u not in buffers:
                buffers[u] = [None] * max(1, n_in[u])
            return buffers[u]

        def add_into(u: int, nr: int, g: Any) -> None:
            buf = buffer(u)
            buf[nr] = g if buf[nr] is None else self._add(buf[nr], g)

        for u, g in grad_roots.items():
            add_into(u, 0, g)
        ready = list(plan.ready)  # already a heap
        pending_sends = set(sends)
        ran_recvs: set[int] = set()
        order: list[int] = []
        # Deferred parts: (node, part, its edges), computed once no node is ready.
        later: deque[tuple[int, Deferred, list[int]]] = deque()

        def pass_on(u: int, edges: Iterable[int], outs: Sequence[Any]) -> None:
            parts: dict[int, tuple[Deferred, list[int]]] | None = None
            for e, g in zip(edges, outs, strict=True):
                if type(g) is Deferred:
                    if parts is None:
                        parts = {}
                    parts.setdefault(id(g), (g, []))[1].append(e)
                    continue
                v = dst[e]
                if g is not None:
                    add_into(v, input_nr[e], g)
                counts[v] -= 1
                if counts[v] == 0 and needed[v]:
                    heapq.heappush(ready, prio[v])
            if parts:
                later.extend((u, part, es) for part, es in parts.values())

        while ready or pending_sends or later:
            if not ready and later:
                u, part, edges = later.popleft()
                try:
                    done = part.compute()
                    if len(done) != len(edges):
                        raise ValueError(
                            f"a deferred part returned {len(done)} gradients for "
                            f"{len(edges)} next edges"
                        )
                except DistBackwardError:
                    raise
                except Exception as exc:
                    raise node_error(graph, u, exc, worker) from exc
                except BaseException as exc:
                    mark_node(exc, graph, u)
                    raise
                pass_on(u, edges, done)
                continue
            if not ready:
                assert ctx is not None and worker is not None
                send_node, g = ctx.receive(worker)
                pending_sends.discard(send_node)
                if g is not None:
                    add_into(send_node, 0, g)
                if counts[send_node] == 0 and needed[send_node]:
                    heapq.heappush(ready, prio[send_node])
                continue
            if ctx is not None and worker is not None:
                ctx.raise_if_failed(worker)
            u = -heapq.heappop(ready)
            u %= n
            inputs = buffers.pop(u, None) or [None] * max(1, n_in[u])
            order.append(u)
            kind = kinds[u]
            try:
                if kind == NodeKind.ACCUMULATE:
                    self._accumulate_param(params[u], inputs[0])
                    continue
                if kind == NodeKind.RECV:
                    assert ctx is not None and worker is not None
                    ctx.deliver(worker, u, inputs[0])
                    ran_recvs.add(u)
                    continue
                lo, hi = indptr[u], indptr[u + 1]
                fn = functions.get(u)
                if fn is None and kind != NodeKind.SEND:
                    raise KeyError(f"no backward function was given for node {u}")
                if fn is None or all(g is None for g in inputs):
                    # A send passes its gradient on; no gradient in means none out.
                    outs: Sequence[Any] = [inputs[0]] * (hi - lo)
                else:
                    outs = fn(inputs)
                if len(outs) != hi - lo:
                    raise ValueError(
                        f"the function returned {len(outs)} gradients for {hi - lo} next edges"
                    )
            except DistBackwardError:
                raise
            except Exception as exc:
                raise node_error(graph, u, exc, worker) from exc
            except BaseException as exc:
                mark_node(exc, graph, u)
                raise
            pass_on(u, range(lo, hi), outs)
        if ctx is not None and worker is not None:
            for r in recvs_here:
                if r not in ran_recvs:
                    ctx.deliver(worker, r, None)
        return tuple(order)

    def _accumulate_param(self, param: int, grad: Any) -> None:
        if grad is not None:
            self.grads[param] = self._accumulate(self.grads.get(param), grad)
        for hook in list(self._hooks.get(param, {}).values()):
            hook(param, self.grads.get(param))
