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
The contexts' opening and closing are :mod:`.dist_contexts`'s; what runs inside is here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from xgrad.failure import RankError, describe
from xgrad.torch_backend.dist_accumulate import Accumulate, keep
from xgrad.torch_backend.dist_bytes import forward_step
from xgrad.torch_backend.dist_context_state import Context
from xgrad.torch_backend.dist_contexts import (
    UnknownContextError,
    current_context,
    find_context,
    open_context,
)
from xgrad.torch_backend.dist_edges import (
    may_have_hooks,
    received_here,
    send_edge,
    sends_gradient,
)
from xgrad.torch_backend.dist_graph import build_rank_graph
from xgrad.torch_backend.dist_inbox import Inbox
from xgrad.torch_backend.dist_ledger import step_mismatch
from xgrad.torch_backend.dist_pass import DistBackwardError, ProcessPass, end
from xgrad.torch_backend.dist_waves import run_pass
from xgrad.torch_backend.failure import transfer_error

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


def context(
    group: Any = None, timeout: float | timedelta = 60.0, *, step: int | str | None = None
) -> contextlib.AbstractContextManager[int]:
    """Open a distributed autograd context on ``group``; every rank of the group enters.

    Args:
        group: the process group (None: the default group).
        timeout: seconds (or a ``timedelta``) any wait of the context (a ``recv``, the backward pass) may last;
            a rank that stopped answering is named sooner, when its heartbeat stops
            (``XGRAD_HEARTBEAT_TIMEOUT``, 10 s by default).
        step: a label of the step (an int or a str) the context is for, the same on every
            rank. Every tensor sent in the context carries it and every ``recv`` checks
            it: a rank that skipped a context (or opened one more) pairs its next one with
            the others' current one, which, unlabelled, gives numbers one step off without
            a word; labelled, that context fails on every rank, naming both ranks and both
            labels (``"rank 1 is in step 5, rank 0 in step 4"``). None (the default): no
            label, nothing checked, nothing more sent.

    Returns:
        A context manager whose ``as`` target is the context id, for :func:`backward`
        and :func:`get_gradients` (opened and closed by :mod:`.dist_contexts`).

    An exception raised inside the block is reported to every rank of the context (as
    ``"rank R in forward: ..."``); on leaving, everything of the context is dropped.

    Contexts pair up across ranks in the order each rank opens them on a group, so a
    group has at most one open context per process: opening one on a group another
    thread has open raises (threads need a process group each), and, as in PyTorch, a
    thread opens one context at a time.
    """
    return open_context(group, timeout, leader=DONE_VIA == "leader", step=step)


def send(tensor: torch.Tensor, dst: int) -> None:
    """Send ``tensor`` to rank ``dst`` of the context; its gradient comes back in backward.

    With grad mode off (``torch.no_grad``, ``torch.inference_mode``) it is sent detached,
    as PyTorch's RPC gives a tensor sent then no gradient back: the receiver's tensor
    does not require grad and nothing flows back (a leaf sent so gets no gradient).
    ``dst`` may be this rank, as PyTorch's RPC may call itself (:mod:`.dist_self`).
    """
    ctx = current_context("send", leader=DONE_VIA == "leader")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor is a {type(tensor).__name__}, not a torch.Tensor")
    tracked = sends_gradient(tensor)
    if ctx.rank_of(dst, "dst") == ctx.me:
        ctx.to_self.send(tensor, tracked)
        return
    link = ctx.link(dst, "dst")
    try:
        ctx.works.append((dst, link.send_tensor(tensor if tracked else tensor.detach())))
    except RuntimeError as exc:  # gloo: the connection to a dead peer is closed
        raise ctx.error(transfer_error(ctx.channel, f"send to rank {dst}", exc, dst)) from exc
    ctx.ledger.sent_to(dst, tracked)
    if tracked:
        ctx.sends.append((dst, ctx.number("send", dst), tensor, send_edge(tensor)))


def recv(src: int) -> torch.Tensor:
    """Receive the next tensor rank ``src`` sent in this context (bounded by the timeout).

    Shape and dtype travel with the tensor; it requires grad when the sent one did, with a
    ``RecvBackward`` node as its ``grad_fn`` (:class:`~.dist_edges.Recv`; not a leaf, so
    in-place ops work, as on PyTorch's received tensors); under ``torch.inference_mode``
    it needs none, and its sender gets no gradient for it. From this rank itself: at once,
    a copy whose ``grad_fn`` leads to the sent tensor.
    """
    ctx = current_context("recv", leader=DONE_VIA == "leader")
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
    theirs = forward_step(header[0])
    if theirs != link.step:
        raise _in_another_step(ctx, src, theirs)
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


def _in_another_step(ctx: Context, src: int, theirs: bytes | None) -> DistBackwardError:
    """The error of a tensor from ``src`` whose context has another step label (``theirs``)
    than this rank's, posted first (so the sender, the other ranks, raise it too)."""
    label = None if theirs is None else theirs.decode("utf-8", "replace")
    message = step_mismatch({ctx.me: ctx.step, src: label}, ctx.me)
    failure = ctx.channel.post(f"recv from rank {src}", message)
    return ctx.error(RankError(failure, ctx.me))


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
    ctx = find_context(context_id)
    if ctx.graph_freed:
        raise RuntimeError(
            f"backward was already run in context {context_id} without retain_graph=True"
        )
    ctx.ledger.passes += 1
    ctx.ledger.enter("pass")
    inbox = ctx.inbox()
    ctx.in_backward = True
    ctx.seen.pass_key = (ctx.id, ctx.ledger.passes)  # "any" multi-grad hooks: once a pass
    try:
        grads, leaves, accumulate, walked = _run(ctx, inbox, roots)
    except BaseException:
        ctx.answered = True  # the pass's inbox poisoned what this rank owed
        ctx.answer_unreceived()
        raise
    finally:
        ctx.in_backward = False
        ctx.seen.pass_key = None
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
    return {leaf: grad for leaf, grad in find_context(context_id).grads.values()}


def is_available() -> bool:
    """Whether distributed autograd can run here, as PyTorch's ``is_available``: xgrad's
    needs ``torch.distributed`` (c10d), not the RPC framework PyTorch's needs."""
    return bool(dist.is_available())


def _is_valid_context(context_id: int) -> None:
    """Raise :class:`UnknownContextError` unless ``context_id`` names an open context of
    this process (PyTorch's ``_is_valid_context``, which code written for it calls)."""
    find_context(context_id)
