"""Distributed autograd across processes on c10d, mirroring ``torch.distributed.autograd``.

>>> from xgrad.torch_backend import dist_autograd              # doctest: +SKIP
>>> with dist_autograd.context() as context_id:                # every rank of the group
...     if rank == 0:
...         dist_autograd.send(x * w, dst=1)
...     else:
...         loss = (dist_autograd.recv(src=0) ** 2).sum()
...     dist_autograd.backward(context_id, [loss] if rank == 1 else [])
...     grads = dist_autograd.get_gradients(context_id)       # {w: dloss/dw} on rank 0

Tensors travel point to point on the group (gloo or NCCL, the same code); the backward
pass is run by xgrad's engine with xgrad's dependency computation, from the roots and
every send of the context, each ``recv`` returning its gradient to the matching ``send``.
A failure on any rank (an exception in a node, a hook, a send or recv, the forward code;
a rank that dies or freezes) raises :class:`DistBackwardError` on every rank, naming the
rank and where it started; the context's state is dropped so the next context works.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from xgrad.failure import RankError, check_seconds, wait_until
from xgrad.torch_backend.dist_graph import build_rank_graph
from xgrad.torch_backend.dist_inbox import Inbox, bury, bury_sent
from xgrad.torch_backend.dist_pass import (
    Accumulate,
    DistBackwardError,
    DistBackwardUnresponsiveError,
    ProcessPass,
    barrier,
    end,
)
from xgrad.torch_backend.dist_waves import run_pass
from xgrad.torch_backend.dist_wire import POISON, Link, header_device
from xgrad.torch_backend.failure import (
    failure_channel,
    group_ranks,
    transfer_failed,
    wait_posted,
)

__all__ = ["DistBackwardError", "backward", "context", "get_gradients", "recv", "send"]

#: how a rank's local graph runs: "nodes" (xgrad's engine calling each ``grad_fn``) or
#: "waves" (torch's engine, one call per set of outputs whose gradients are there,
#: :mod:`.dist_waves`; passes whose leaves have tensor hooks still run on nodes). They
#: measured alike on ``bench dist-autograd`` (waves/nodes 0.95-1.06 A/B).
EXECUTE = os.environ.get("XGRAD_DIST_EXECUTE", "nodes")
#: how a pass ends: "leader" (every rank tells the group's lowest rank it is done, which
#: tells each once all are) or "all" (every rank tells every other).
DONE_VIA = os.environ.get("XGRAD_DIST_DONE", "leader")


def _error(context_id: int, exc: RankError) -> DistBackwardError:
    """The user's error for a failure of the context (which is marked as reported)."""
    ctx = _open.get(context_id)
    if ctx is not None:
        ctx.reported = True
    cls = DistBackwardError if exc.failure.kind == "error" else DistBackwardUnresponsiveError
    return cls(context_id, exc)


class _Context:
    """The state of one open context on this rank (dropped when it closes)."""

    def __init__(self, context_id: int, pg: Any, name: str, seq: int, timeout: float) -> None:
        self.id = context_id
        self.pg = pg
        self.name = name
        self.seq = seq
        self.timeout = timeout
        self.ranks = group_ranks(pg)
        self.me = dist.get_rank()
        self.channel = failure_channel(pg, f"dist_autograd/{seq}")
        self.device = header_device(pg)
        self.links: dict[int, Link] = {}
        self.sends: list[tuple[int, int, torch.Tensor]] = []
        self.recvs: list[tuple[int, int, torch.Tensor]] = []
        self.counts: dict[tuple[str, int], int] = {}
        self.works: list[Any] = []
        self.grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.passes = 0
        self.graph_freed = False
        # Whether this rank already raised the context's failure to the user.
        self.reported = False
        # Whether a failed pass already answered what its peers wait for (with poison).
        self.answered = False

    def link(self, peer: Any, arg: str) -> Link:
        if not isinstance(peer, int) or isinstance(peer, bool):
            raise TypeError(f"{arg}={peer!r} must be an int rank")
        if peer not in self.ranks or peer == self.me:
            raise ValueError(
                f"{arg}={peer} is not another rank of the context's group {self.ranks} "
                f"(this is rank {self.me})"
            )
        if peer not in self.links:
            group_peer = dist.get_group_rank(self.pg, peer)
            self.links[peer] = Link(
                self.pg, self.channel.store, self.channel.prefix, self.me, peer, group_peer,
                self.seq, self.device,
            )  # fmt: skip
        return self.links[peer]

    def inbox(self) -> Inbox:
        """Post the receives of a backward pass: from every peer, its gradients, its "done"."""
        for peer in self.ranks:
            if peer != self.me:
                self.link(peer, "peer")
        expect: dict[int, list[int]] = {}
        for peer, _, t in self.sends:
            expect.setdefault(peer, []).append(t.numel() * t.element_size())
        return Inbox(
            self.name, self.links, expect, self.owed(), self.channel, self.timeout,
            dones=self.dones(),
        )  # fmt: skip

    def leader(self) -> int | None:
        """The rank that collects the others' "done" (None: every rank tells every other)."""
        return min(self.ranks) if DONE_VIA == "leader" else None

    def dones(self) -> list[int]:
        """The peers this rank exchanges "done" with."""
        leader = self.leader()
        if leader is None or leader == self.me:
            return [p for p in self.ranks if p != self.me]
        return [leader]

    def owed(self) -> dict[int, list[int]]:
        """Peer -> byte sizes of the gradients this rank answers it with in each pass."""
        owe: dict[int, list[int]] = {}
        for peer, _, t in self.recvs:
            owe.setdefault(peer, []).append(t.numel() * t.element_size())
        return owe

    def poison(self) -> None:
        """A failure outside backward: answer every message a peer's pass would wait for."""
        owe = self.owed()
        for peer in self.ranks:
            if peer == self.me:
                continue
            link = self.link(peer, "peer")
            link.start_backward(owe.get(peer, ()))
            try:
                for _ in owe.get(peer, ()):
                    bury(*link.send_backward(POISON, 0, None))
                if peer in self.dones():
                    bury(*link.send_backward(POISON, 0, None, final=True))
            except RuntimeError:  # gloo: that peer's connection is gone; nothing waits
                continue

    def number(self, what: str, peer: int) -> int:
        k = self.counts.get((what, peer), 0)
        self.counts[(what, peer)] = k + 1
        return k

    def wait(self, work: Any, what: str, peer: int) -> None:
        """Wait for a transfer whose other side is posted (announced or confirmed)."""
        try:
            wait_posted(work, self.channel, timeout=self.timeout, what=what, peer=peer)
        except RankError as exc:
            raise _error(self.id, exc) from None

    def wait_for(self, ready: Any, what: str) -> None:
        try:
            wait_until(ready, self.channel, timeout=self.timeout, what=what)
        except RankError as exc:
            raise _error(self.id, exc) from None

    def close(self) -> None:
        """Make sure every send was received: a store barrier, then the sends' works.

        Every rank leaves through the barrier (whether a rank still has sends in flight is
        not known to the others), so past it every receive was made. After a failure
        this rank already raised (and the user caught), nothing is awaited.
        """
        if self.reported:
            bury_sent(self.works)
            return
        try:
            barrier(self.channel, "exit", len(self.ranks), self.timeout)
        except RankError as exc:
            raise _error(self.id, exc) from None
        for peer, (work, _) in self.works:
            self.wait(work, f"context exit, send to rank {peer}", peer)
        try:
            self.channel.check()
        except RankError as exc:
            raise _error(self.id, exc) from None


_ids = itertools.count(1)
_seqs: dict[str, int] = {}
_open: dict[int, _Context] = {}
_local = threading.local()
_lock = threading.Lock()


def _current(what: str) -> _Context:
    stack = getattr(_local, "stack", None)
    if not stack:
        raise RuntimeError(f"{what} must be called inside `with dist_autograd.context():`")
    ctx: _Context = stack[-1]
    return ctx


def _get(context_id: int) -> _Context:
    ctx = _open.get(context_id)
    if ctx is None:
        raise ValueError(
            f"context_id={context_id!r} is not an open distributed autograd context "
            f"(open: {sorted(_open)})"
        )
    return ctx


@contextlib.contextmanager
def context(group: Any = None, timeout: float = 60.0) -> Iterator[int]:
    """Open a distributed autograd context on ``group``; every rank of the group enters.

    Args:
        group: the process group (None: the default group).
        timeout: seconds any wait of the context (a ``recv``, the backward pass) may last;
            a rank that stopped answering is named sooner, when its heartbeat stops
            (``XGRAD_HEARTBEAT_TIMEOUT``, 10 s by default).

    Yields:
        The context id, for :func:`backward` and :func:`get_gradients`.

    An exception raised inside the block is reported to every rank of the context (as
    ``"rank R in forward: ..."``); on leaving, everything of the context is dropped.
    """
    timeout = check_seconds("timeout", timeout)
    pg = dist.group.WORLD if group is None else group
    if pg is None:
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
    name = str(dist.distributed_c10d._get_process_group_name(pg))
    with _lock:
        seq = _seqs[name] = _seqs.get(name, 0) + 1
        ctx = _Context(next(_ids), pg, name, seq, timeout)
        _open[ctx.id] = ctx
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(ctx)
    ok = False
    try:
        yield ctx.id
        ctx.close()
        ok = True
    except BaseException as exc:
        if not isinstance(exc, RankError):
            ctx.channel.post("forward", f"{type(exc).__name__}: {exc}")
        if not ctx.answered:
            # Peers in a backward pass wait on this rank's own thread-free receives,
            # which only a message ends: a failure outside a pass (this rank's, or
            # another's seen in a forward recv) answers the next pass's messages.
            ctx.poison()
        raise
    finally:
        stack.remove(ctx)
        with _lock:
            _open.pop(ctx.id, None)
        if not ok:
            bury_sent(ctx.works)


def send(tensor: torch.Tensor, dst: int) -> None:
    """Send ``tensor`` to rank ``dst`` of the context; its gradient comes back in backward."""
    ctx = _current("send")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor is a {type(tensor).__name__}, not a torch.Tensor")
    link = ctx.link(dst, "dst")
    try:
        ctx.works.append((dst, link.send_tensor(tensor)))
    except RuntimeError as exc:  # gloo: the connection to a dead peer is closed
        raise _error(ctx.id, transfer_failed(ctx.channel, f"send to rank {dst}", exc, dst)) from exc
    if tensor.requires_grad:
        ctx.sends.append((dst, ctx.number("send", dst), tensor))


def recv(src: int) -> torch.Tensor:
    """Receive the next tensor rank ``src`` sent in this context (bounded by the timeout).

    Shape and dtype travel with the tensor; it requires grad when the sent one did.
    """
    ctx = _current("recv")
    link = ctx.link(src, "src")
    ctx.wait_for(link.tensor_ready, f"recv from rank {src}")
    try:
        work, buf, requires_grad = link.recv_tensor()
    except RuntimeError as exc:
        raise _error(
            ctx.id, transfer_failed(ctx.channel, f"recv from rank {src}", exc, src)
        ) from exc
    ctx.wait(work, f"recv from rank {src}", src)
    if requires_grad:
        buf.requires_grad_()
        ctx.recvs.append((src, ctx.number("recv", src), buf))
    return buf


def backward(
    context_id: int,
    roots: Sequence[torch.Tensor],
    retain_graph: bool = False,
    *,
    accumulate_grad: bool = False,
) -> None:
    """Run the distributed backward pass of the context; every rank of the group calls it.

    Args:
        context_id: the id :func:`context` yielded.
        roots: scalar tensors to differentiate (``[]`` on a rank that only forwards).
        retain_graph: allow another backward pass through the same graph in this context.
        accumulate_grad: also add the leaves' gradients into their ``.grad`` (for ordinary
            optimizers); they always accumulate in the context (:func:`get_gradients`).

    Raises:
        DistBackwardError: on every rank, when any rank failed (named), or a rank stopped
            answering within the context's timeout.
    """
    ctx = _get(context_id)
    if ctx.graph_freed:
        raise RuntimeError(
            f"backward was already run in context {context_id} without retain_graph=True"
        )
    roots = list(roots)
    ctx.passes += 1
    inbox = ctx.inbox()
    try:
        _run(ctx, inbox, roots, retain_graph, accumulate_grad)
    except BaseException:
        ctx.answered = True  # the pass's inbox poisoned what this rank owed
        raise


def _run(
    ctx: _Context,
    inbox: Inbox,
    roots: list[torch.Tensor],
    retain_graph: bool,
    accumulate_grad: bool,
) -> None:
    try:
        rank_graph = build_rank_graph(
            roots,
            [(t, f"send to rank {p}") for p, _, t in ctx.sends],
            [(t, f"recv from rank {p}") for p, _, t in ctx.recvs],
        )
    except Exception as exc:  # bad roots: the others must not wait for this rank
        failure = ctx.channel.post("backward", f"{type(exc).__name__}: {exc}")
        end(inbox, failed=True)
        raise _error(ctx.id, RankError(failure, ctx.me)) from exc
    sends = [
        (p, k, t, node) for (p, k, t), node in zip(ctx.sends, rank_graph.send_nodes, strict=True)
    ]
    recvs = {node: ctx.recvs[i] for node, i in rank_graph.recv_nodes.items()}
    reached = set(rank_graph.recv_nodes.values())
    unreached = [(p, k) for i, (p, k, _) in enumerate(ctx.recvs) if i not in reached]
    accumulate = Accumulate()
    try:
        pass_ = ProcessPass(
            ctx.id, ctx.ranks, ctx.me, inbox, sends, recvs, ctx.channel,
            lambda exc: _error(ctx.id, exc), unreached, leader=ctx.leader(), keep=ctx.works,
        )  # fmt: skip
    except BaseException:
        end(inbox, failed=True)
        raise
    sent, received = [t for _, _, t in ctx.sends], [t for _, _, t in ctx.recvs]
    grads = run_pass(EXECUTE, pass_, ctx.me, rank_graph, roots, sent, received, accumulate)
    with torch.no_grad():
        for i in list(grads):
            grad = grads.pop(i)  # only this frame holds it now: see Accumulate.private
            leaf = rank_graph.leaves[i]
            old = ctx.grads.get(id(leaf))
            kept = accumulate.private(grad, leaf) if old is None else old[1] + grad
            ctx.grads[id(leaf)] = (leaf, kept)
            if accumulate_grad:
                leaf.grad = grad.clone() if leaf.grad is None else leaf.grad + grad
    if not retain_graph:
        ctx.graph_freed = True


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """``{leaf tensor: gradient}`` accumulated in the context by its backward passes."""
    return {leaf: grad for leaf, grad in _get(context_id).grads.values()}
