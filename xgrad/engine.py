"""Runs a backward graph: a ready queue driven by dependency counts, hooks, errors, contexts.

The engine is array-agnostic: node functions receive and return arrays of any library
(numpy in the reference backend) and the engine only adds them where edges meet.

A local pass::

    engine = Engine()
    engine.register_post_accumulate_hook(0, reducer.mark_ready)
    result = engine.backward(graph, functions, {loss_node: ones})

A distributed pass (:class:`DistContext`) runs one engine per worker; ``recv`` nodes send
their gradient back to the matching ``send`` node of another worker. The first error on
any worker stops the pass on every worker, each raising :class:`DistBackwardError` naming
the worker it came from, and the context is released everywhere so the next pass works.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xgrad.dependencies import compute_dependencies
from xgrad.graph import BackwardGraph, NodeKind

#: A node's backward: one gradient per input (None where none arrived) -> one per next edge
#: (None: no gradient along that edge).
NodeFunction = Callable[[list[Any]], Sequence[Any]]
#: Called after a parameter's gradient was accumulated: ``hook(param_index, accumulated)``;
#: the reducer's ``mark_ready`` has exactly this signature.
PostAccumulateHook = Callable[[int, Any], None]

DEFAULT_TIMEOUT_S = 60.0


class BackwardError(RuntimeError):
    """A node failed during a backward pass; the pass was stopped and its state dropped.

    Attributes:
        node: the failing node's id, or -1 when the failure was not inside a node (a timeout).
        node_name: its label.
        worker: the worker it happened on (None in a local pass).
        message: the original error's text.
    """

    def __init__(self, node: int, node_name: str, message: str, worker: int | None = None):
        self.node = node
        self.node_name = node_name
        self.message = message
        self.worker = worker
        where = "" if worker is None else f" on worker {worker}"
        at = "" if node < 0 else f" at node {node} ({node_name})"
        super().__init__(f"backward pass failed{where}{at}: {message}")


class DistBackwardError(BackwardError):
    """Raised on every worker of a distributed pass when any of them failed.

    ``worker`` is the worker the error came from; ``context_id`` the pass; ``raised_on``
    the worker that raises this copy.
    """

    def __init__(
        self, context_id: int, raised_on: int, node: int, node_name: str, message: str, worker: int
    ):
        self.context_id = context_id
        self.raised_on = raised_on
        super().__init__(node, node_name, f"(context {context_id}) {message}", worker)


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


class DistContext:
    """One distributed backward pass shared by in-process workers (threads).

    The forward pass records, for every tensor sent from worker A to worker B, a ``send``
    node in A's graph and a ``recv`` node in B's graph, and links them with :meth:`link`.
    In the backward pass B's ``recv`` node delivers its gradient to A's ``send`` node.

    A worker whose ``recv`` node was not reached still tells the other side (with no
    gradient) when it finishes, so no worker waits for a gradient that cannot come. Every
    wait is bounded by ``timeout`` seconds; running past it fails the pass, naming the
    worker that waited.
    """

    _ids = itertools.count(1)

    def __init__(self, workers: Iterable[int], *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.context_id = next(DistContext._ids)
        self.workers = tuple(sorted(set(workers)))
        if not self.workers:
            raise ValueError("workers is empty; a distributed pass needs at least one worker")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds")
        self.timeout = timeout
        self._routes: dict[tuple[int, int], tuple[int, int]] = {}
        self._sends: dict[int, list[int]] = {w: [] for w in self.workers}
        self._cond = threading.Condition()
        self._mail: dict[int, deque[tuple[int, Any]]] = {w: deque() for w in self.workers}
        self._done: set[int] = set()
        self._released: set[int] = set()
        #: ``(worker, node, node name, message)`` of the first failure, if any.
        self.error: tuple[int, int, str, str] | None = None

    def link(self, send_worker: int, send_node: int, recv_worker: int, recv_node: int) -> None:
        """Record that ``recv_node`` on ``recv_worker`` returns its gradient to ``send_node``."""
        for w in (send_worker, recv_worker):
            if w not in self._mail:
                raise ValueError(f"worker {w} is not in this context's workers {self.workers}")
        key = (recv_worker, recv_node)
        if key in self._routes:
            raise ValueError(f"recv node {recv_node} of worker {recv_worker} is linked twice")
        self._routes[key] = (send_worker, send_node)
        self._sends[send_worker].append(send_node)

    def sends_of(self, worker: int) -> tuple[int, ...]:
        return tuple(self._sends[worker])

    def recvs_of(self, worker: int) -> dict[int, tuple[int, int]]:
        """``{recv node: (send worker, send node)}`` for ``worker``'s recv nodes."""
        return {r: dst for (w, r), dst in self._routes.items() if w == worker}

    def deliver(self, recv_worker: int, recv_node: int, grad: Any) -> None:
        """Send ``grad`` (None: no gradient) from a recv node to its send node's worker."""
        try:
            peer, send_node = self._routes[(recv_worker, recv_node)]
        except KeyError:
            raise ValueError(
                f"recv node {recv_node} of worker {recv_worker} is not linked to a send node"
            ) from None
        with self._cond:
            self._mail[peer].append((send_node, grad))
            self._cond.notify_all()

    def receive(self, worker: int) -> tuple[int, Any]:
        """Wait for the next ``(send node, gradient)`` for ``worker`` (bounded; raises on failure)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                if self.error is not None:
                    raise self._copy_error(worker)
                if self._mail[worker]:
                    return self._mail[worker].popleft()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        raise self.fail(
            worker, -1, "", f"timed out after {self.timeout}s waiting for gradients from peers"
        )

    def fail(self, worker: int, node: int, node_name: str, message: str) -> DistBackwardError:
        """Record the pass's first error and wake every worker; returns this worker's copy."""
        with self._cond:
            if self.error is None:
                self.error = (worker, node, node_name, message)
            self._cond.notify_all()
            return self._copy_error(worker)

    def finish(self, worker: int) -> None:
        """Wait until every worker finished its part; raises if any failed (bounded)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            self._done.add(worker)
            self._cond.notify_all()
            while True:
                if self.error is not None:
                    raise self._copy_error(worker)
                if len(self._done) == len(self.workers):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(self.workers) - self._done)
                    break
                self._cond.wait(left)
        raise self.fail(
            worker, -1, "", f"timed out after {self.timeout}s; workers {missing} did not finish"
        )

    def release(self, worker: int) -> None:
        with self._cond:
            self._released.add(worker)
            self._mail[worker].clear()

    @property
    def released(self) -> bool:
        """True once every worker let go of the context."""
        with self._cond:
            return len(self._released) == len(self.workers)

    def raise_if_failed(self, worker: int) -> None:
        """Stop early: raise this worker's copy of the pass's error, if another worker failed."""
        with self._cond:
            if self.error is not None:
                raise self._copy_error(worker)

    def _copy_error(self, worker: int) -> DistBackwardError:
        assert self.error is not None
        origin, node, node_name, message = self.error
        return DistBackwardError(self.context_id, worker, node, node_name, message, origin)


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
                the gradient accumulated so far, as autograd's post hooks do.
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
            try:
                order = self._run(graph, functions, grad_roots or {}, None, ctx, worker)
            except DistBackwardError:
                raise
            except BackwardError as exc:
                raise ctx.fail(worker, exc.node, exc.node_name, exc.message) from exc
            except Exception as exc:  # a bad graph or link: the others must not wait for us
                raise ctx.fail(worker, -1, "", f"{type(exc).__name__}: {exc}") from exc
            ctx.finish(worker)
            return PassResult(order, ctx.context_id)
        finally:
            ctx.release(worker)
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
        deps = compute_dependencies(graph, grad_roots.keys(), sends, outputs=outputs)
        kinds = graph.kinds
        recvs_here = ctx.recvs_of(worker) if ctx is not None and worker is not None else {}
        reached_recvs = np.flatnonzero(deps.reachable & (kinds == NodeKind.RECV)).tolist()
        for r in reached_recvs:
            if r not in recvs_here:
                raise ValueError(
                    f"recv node {r} ({graph.name(r)!r}) is reached but not linked to a send "
                    "node of a distributed context"
                )
        counts = deps.counts.tolist()
        needed = deps.needed.tolist()
        n_in = graph.num_inputs()
        indptr = graph.indptr
        n = graph.num_nodes
        buffers: dict[int, list[Any]] = {}
        ready: list[int] = []

        def priority(u: int) -> int:
            # Highest first, accumulators before everything (as autograd's AccumulateGrad,
            # whose sequence number is the largest), then later-created nodes first.
            return -(u + (n if kinds[u] == NodeKind.ACCUMULATE else 0))

        def buffer(u: int) -> list[Any]:
            if u not in buffers:
                buffers[u] = [None] * max(1, int(n_in[u]))
            return buffers[u]

        def add_into(u: int, nr: int, g: Any) -> None:
            buf = buffer(u)
            buf[nr] = g if buf[nr] is None else self._add(buf[nr], g)

        for u, g in grad_roots.items():
            add_into(u, 0, g)
        for u in deps.roots:
            if counts[u] == 0 and needed[u]:
                heapq.heappush(ready, priority(u))
        pending_sends = set(sends)
        ran_recvs: set[int] = set()
        order: list[int] = []
        while ready or pending_sends:
            if not ready:
                assert ctx is not None and worker is not None
                send_node, g = ctx.receive(worker)
                pending_sends.discard(send_node)
                if g is not None:
                    add_into(send_node, 0, g)
                if counts[send_node] == 0 and needed[send_node]:
                    heapq.heappush(ready, priority(send_node))
                continue
            if ctx is not None and worker is not None:
                ctx.raise_if_failed(worker)
            u = -heapq.heappop(ready)
            u = u - n if u >= n else u
            inputs = buffers.pop(u, None) or [None] * max(1, int(n_in[u]))
            order.append(u)
            kind = kinds[u]
            try:
                if kind == NodeKind.ACCUMULATE:
                    self._accumulate_param(int(graph.params[u]), inputs[0])
                    continue
                if kind == NodeKind.RECV:
                    assert ctx is not None and worker is not None
                    ctx.deliver(worker, u, inputs[0])
                    ran_recvs.add(u)
                    continue
                lo, hi = int(indptr[u]), int(indptr[u + 1])
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
                raise BackwardError(
                    u, graph.name(u), f"{type(exc).__name__}: {exc}", worker
                ) from exc
            for e, g in zip(range(lo, hi), outs, strict=True):
                v = int(graph.dst[e])
                if g is not None:
                    add_into(v, int(graph.input_nr[e]), g)
                counts[v] -= 1
                if counts[v] == 0 and needed[v]:
                    heapq.heappush(ready, priority(v))
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
