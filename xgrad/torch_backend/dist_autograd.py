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

from xgrad.failure import RankError, check_seconds, describe
from xgrad.torch_backend import dist_hooks
from xgrad.torch_backend.dist_accumulate import Accumulate, keep
from xgrad.torch_backend.dist_context_state import Context
from xgrad.torch_backend.dist_edges import may_have_hooks, received_here, send_edge
from xgrad.torch_backend.dist_graph import build_rank_graph
from xgrad.torch_backend.dist_graveyard import bury_sent
from xgrad.torch_backend.dist_inbox import Inbox
from xgrad.torch_backend.dist_pass import DistBackwardError, ProcessPass, end
from xgrad.torch_backend.dist_release import release_saved
from xgrad.torch_backend.dist_waves import run_pass
from xgrad.torch_backend.failure import transfer_error
from xgrad.torch_backend.private_groups import require_member

__all__ = [
    "DistBackwardError",
    "UnknownContextError",
    "backward",
    "context",
    "get_gradients",
    "is_available",
    "recv",
    "send",
]

#: how a rank's local graph runs: "nodes" (xgrad's engine calling each ``grad_fn``) or
#: "waves" (torch's engine, one call per set of outputs whose gradients are there,
#: :mod:`.dist_waves`; passes whose leaves have tensor hooks still run on nodes). They
#: measured alike on ``bench dist-autograd`` (waves/nodes 0.95-1.06 A/B).
EXECUTE = os.environ.get("XGRAD_DIST_EXECUTE", "nodes")
#: how a pass ends: "leader" (every rank tells the group's lowest rank it is done, which
#: tells each once all are) or "all" (every rank tells every other).
DONE_VIA = os.environ.get("XGRAD_DIST_DONE", "leader")


_ids = itertools.count(1)
_seqs: dict[str, int] = {}
_open: dict[int, Context] = {}
#: group name -> the thread that has a context open on it
_holders: dict[str, int] = {}
_local = threading.local()
_lock = threading.Lock()


def _current(what: str) -> Context:
    ctx: Context | None = getattr(_local, "context", None)
    if ctx is None:
        raise RuntimeError(f"{what} must be called inside `with dist_autograd.context():`")
    if ctx.in_backward:
        # A checkpointed function's forward runs again in backward: its send would go to a
        # peer that takes no more (or its recv wait for one that sends none).
        raise RuntimeError(
            f"{what} during the backward pass of context {ctx.id}: a checkpointed "
            "function that sends or receives runs again in backward; keep send and recv "
            "outside checkpointed regions"
        )
    return ctx


class UnknownContextError(ValueError, RuntimeError):
    """A context id that names no open context of this process.

    Both a ``ValueError`` (a bad argument, as xgrad's callers catch it) and a
    ``RuntimeError`` (what PyTorch's ``torch.distributed.autograd`` raises, so code
    written for it catches this too).
    """


def _get(context_id: int) -> Context:
    ctx = _open.get(context_id)
    if ctx is None:
        # PyTorch's wording first, for code and people that look for it.
        raise UnknownContextError(
            f"Could not find autograd context with id: {context_id!r} (context_id="
            f"{context_id!r} is not an open distributed autograd context; open: {sorted(_open)})"
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

    Contexts pair up across ranks in the order each rank opens them on a group, so a
    group has at most one open context per process: opening one on a group another
    thread has open raises (threads need a process group each), and, as in PyTorch, a
    thread opens one context at a time.
    """
    timeout = check_seconds("timeout", timeout)
    pg = dist.group.WORLD if group is None else group
    if pg is None:
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
    require_member(pg, "enter its contexts")
    name = str(dist.distributed_c10d._get_process_group_name(pg))
    if getattr(_local, "context", None) is not None:
        raise RuntimeError(
            "Already have an autograd context id for this thread (context "
            f"{_local.context.id}); leave it before opening another"
        )
    me = threading.get_ident()
    with _lock:
        holder = _holders.get(name)
        if holder is not None:
            raise RuntimeError(
                f"process group {name!r} already has a distributed autograd context open in "
                f"another thread of this process (thread {holder}); contexts pair up across "
                "ranks in the order each rank opens them, so threads that open contexts at "
                "the same time need one process group per thread (torch.distributed.new_group)"
            )
        seq = _seqs[name] = _seqs.get(name, 0) + 1
        _holders[name] = me
    try:
        ctx = Context(next(_ids), pg, name, seq, timeout, leader=DONE_VIA == "leader")
    except BaseException:
        with _lock:
            _holders.pop(name, None)
        raise
    with _lock:
        _open[ctx.id] = ctx
    _local.context = ctx
    dist_hooks.begin(ctx.seen)
    ok = False
    try:
        yield ctx.id
        ctx.close()
        ok = True
    except BaseException as exc:
        if not isinstance(exc, RankError):
            ctx.channel.post("forward", describe(exc))
        if not ctx.answered:
            # Peers in a backward pass wait on this rank's own thread-free receives,
            # which only a message ends: a failure outside a pass (this rank's, or
            # another's seen in a forward recv) answers the next pass's messages.
            ctx.poison()
        raise
    finally:
        _local.context = None
        dist_hooks.end()
        with _lock:
            _open.pop(ctx.id, None)
            _holders.pop(name, None)
        if not ok:
            bury_sent(ctx.works)
            ctx.leave_failed()
        else:  # after the exit's exchange: nothing here is posted to the peers
            release_saved(ctx.ran)


def send(tensor: torch.Tensor, dst: int) -> None:
    """Send ``tensor`` to rank ``dst`` of the context; its gradient comes back in backward.

    ``dst`` may be this rank, as PyTorch's RPC may call itself (:mod:`.dist_self`).
    """
    ctx = _current("send")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor is a {type(tensor).__name__}, not a torch.Tensor")
    if ctx.rank_of(dst, "dst") == ctx.me:
        ctx.to_self.send(tensor)
        return
    link = ctx.link(dst, "dst")
    try:
        ctx.works.append((dst, link.send_tensor(tensor)))
    except RuntimeError as exc:  # gloo: the connection to a dead peer is closed
        raise ctx.error(transfer_error(ctx.channel, f"send to rank {dst}", exc, dst)) from exc
    ctx.ledger.sent_to(dst, tensor.requires_grad)
    if tensor.requires_grad:
        ctx.sends.append((dst, ctx.number("send", dst), tensor, send_edge(tensor)))


def recv(src: int) -> torch.Tensor:
    """Receive the next tensor rank ``src`` sent in this context (bounded by the timeout).

    Shape and dtype travel with the tensor; it requires grad when the sent one did, with a
    ``RecvBackward`` node as its ``grad_fn`` (:class:`~.dist_edges.Recv`; not a leaf, so
    in-place ops work, as on PyTorch's received tensors); under ``torch.inference_mode``
    it needs none, and its sender gets no gradient for it. From this rank itself: at once,
    a copy whose ``grad_fn`` leads to the sent tensor.
    """
    ctx = _current("recv")
    if ctx.rank_of(src, "src") == ctx.me:
        return ctx.to_self.recv()
    link = ctx.link(src, "src")
    ctx.ledger.enter("recv", src)
    header: list[bytes] = []

    def landed() -> bool:
        found = link.take_header()
        if found is not None:
            header.append(found)
        return found is not None

    ctx.wait_for(landed, f"recv from rank {src}", src)
    try:
        work, buf, requires_grad = link.recv_tensor(header[0])
    except RuntimeError as exc:
        raise ctx.error(transfer_error(ctx.channel, f"recv from rank {src}", exc, src)) from exc
    ctx.ledger.received_from(src, requires_grad)
    ctx.ledger.enter("forward")
    ctx.wait(work, f"recv from rank {src}", src, link)
    if requires_grad:
        origin = f"by rank {ctx.me} from rank {src} in context {ctx.id}"
        buf, kept, node = received_here(buf, origin)
        ctx.recvs.append((src, ctx.number("recv", src), kept, node))
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
            optimizers), then run their post-accumulate-grad hooks, once per leaf, as
            AccumulateGrad does; they always accumulate in the context (:func:`get_gradients`).

    Raises:
        DistBackwardError: on every rank, when any rank failed (named), or a rank stopped
            answering within the context's timeout.
    """
    ctx = _get(context_id)
    if ctx.graph_freed:
        raise RuntimeError(
            f"backward was already run in context {context_id} without retain_graph=True"
        )
    ctx.ledger.passes += 1
    ctx.ledger.enter("pass")
    inbox = ctx.inbox()
    ctx.in_backward = True
    try:
        grads, leaves, accumulate, walked = _run(ctx, inbox, roots)
    except BaseException:
        ctx.answered = True  # the pass's inbox poisoned what this rank owed
        ctx.answer_unreceived()
        raise
    finally:
        ctx.in_backward = False
        ctx.ledger.enter("forward")
    if not retain_graph:
        ctx.graph_freed = True
        ctx.ran = walked  # freed at the context's exit, off the pass's path (dist_release)
    try:
        keep(ctx.grads, grads, leaves, accumulate, accumulate_grad)
    except Exception as exc:
        # The pass is over: every rank finished it and this rank owes nothing in it. The
        # others hear of the failure at their next wait; a next pass of theirs waits for
        # this rank's messages, which the context's exit answers (``Context.poison``), as
        # after a failure outside a pass.
        failure = ctx.channel.post("AccumulateGrad", describe(exc))
        raise ctx.error(RankError(failure, ctx.me)) from exc


def _roots(roots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``roots`` as a list; a bare tensor is refused, as PyTorch's ``backward`` refuses it
    (taken as a sequence, a vector root was differentiated element by element as its sum)."""
    if isinstance(roots, torch.Tensor):
        raise TypeError(
            f"roots must be a list of scalar tensors (roots=[loss]), got a tensor of shape "
            f"{tuple(roots.shape)}"
        )
    return list(roots)


def _run(
    ctx: Context, inbox: Inbox, given: Sequence[torch.Tensor]
) -> tuple[dict[int, Any], tuple[torch.Tensor, ...], Accumulate, tuple[Any, ...]]:
    """This rank's part of the pass: ``(leaf index -> gradient, the leaves, how they were
    added, the torch nodes walked)``; raises (every rank does) if any rank failed."""
    roots: list[torch.Tensor] = []
    try:
        roots = _roots(given)
        rank_graph = build_rank_graph(
            roots,
            [(edge, f"send to rank {p}") for p, _, _, edge in ctx.sends],
            [(node, f"recv from rank {p}") for p, _, _, node in ctx.recvs],
            [edge.node for _, _, t, edge in ctx.sends if may_have_hooks(t, edge.node)],
            ctx.seen,
        )
    except Exception as exc:  # bad roots: the others must not wait for this rank
        failure = ctx.channel.post("backward", describe(exc))
        end(inbox, failed=True)
        raise ctx.error(RankError(failure, ctx.me)) from exc
    sends = [
        (p, k, t, node) for (p, k, t, _), node in zip(ctx.sends, rank_graph.send_nodes, strict=True)
    ]
    recvs = {node: ctx.recvs[i] for node, i in rank_graph.recv_nodes.items()}
    reached = set(rank_graph.recv_nodes.values())
    unreached = [(p, k) for i, (p, k, _, _) in enumerate(ctx.recvs) if i not in reached]
    accumulate = Accumulate()
    try:
        pass_ = ProcessPass(
            ctx.id, ctx.ranks, ctx.me, inbox, sends, recvs, ctx.channel,
            ctx.error, unreached, leader=ctx.leader(), keep=ctx.works,
        )  # fmt: skip
    except BaseException:
        end(inbox, failed=True)
        raise
    sent = [edge for _, _, _, edge in ctx.sends]
    taken = [(t, node) for _, _, t, node in ctx.recvs]
    grads, ran = run_pass(EXECUTE, pass_, ctx.me, rank_graph, roots, sent, taken, accumulate)
    walked = rank_graph.walked
    return grads, rank_graph.leaves, accumulate, tuple(walked[u] for u in ran if u in walked)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """``{leaf tensor: gradient}`` accumulated in the context by its backward passes."""
    return {leaf: grad for leaf, grad in _get(context_id).grads.values()}


def is_available() -> bool:
    """Whether distributed autograd can run here, as PyTorch's ``is_available``: xgrad's
    needs ``torch.distributed`` (c10d), not the RPC framework PyTorch's needs."""
    return bool(dist.is_available())


def _is_valid_context(context_id: int) -> None:
    """Raise :class:`UnknownContextError` unless ``context_id`` names an open context of
    this process (PyTorch's ``_is_valid_context``, which code written for it calls)."""
    _get(context_id)
