"""The distributed autograd contexts of this process: opened, paired up, closed.

A context pairs up across ranks by the order each rank opens contexts on a group, so a
group has at most one open context per process, and a thread one at a time; leaving it
closes it with the peers, or, after a failure, tells them and drops what it holds.
Kept apart from what runs inside a context (:mod:`.dist_autograd`: ``send``, ``recv``,
``backward``), which finds its context here (:func:`current_context`, :func:`find_context`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from xgrad.failure import RankError, check_seconds, default_seconds, describe
from xgrad.torch_backend import dist_hooks, dist_left
from xgrad.torch_backend.dist_context_state import Context
from xgrad.torch_backend.dist_graveyard import bury_sent
from xgrad.torch_backend.dist_release import release_saved
from xgrad.torch_backend.private_groups import require_member

__all__ = [
    "OPEN",
    "UnknownContextError",
    "current_context",
    "find_context",
    "leaving",
    "open_context",
]

_ids = itertools.count(1)
_seqs: dict[str, int] = {}
#: id -> the open contexts of this process (every thread's).
OPEN: dict[int, Context] = {}
#: group name -> the thread that has a context open on it
_holders: dict[str, int] = {}
_local = threading.local()
_lock = threading.Lock()


def current_context(what: str, *, leader: bool | None = None) -> Context:
    """This thread's open context, for ``what`` (an operation) to run in.

    Outside any context, with ``leader`` given (how a pass of the default group ends), the
    refused call also spends the default group's next context (:func:`_spend_next`).
    """
    ctx: Context | None = getattr(_local, "context", None)
    if ctx is None:
        exc = RuntimeError(f"{what} must be called inside `with dist_autograd.context():`")
        if leader is not None:
            _spend_next(what, exc, leader)
        raise exc
    if ctx.in_backward:
        # A checkpointed function's forward runs again in backward: its send would go to a
        # peer that takes no more (or its recv wait for one that sends none).
        raise RuntimeError(
            f"{what} during the backward pass of context {ctx.id}: a checkpointed "
            "function that sends or receives runs again in backward; keep send and recv "
            "outside checkpointed regions"
        )
    return ctx


def _spend_next(what: str, exc: RuntimeError, leader: bool) -> None:
    """A ``send`` or ``recv`` outside any context is a step this rank took outside one,
    while its peers ran theirs in one: contexts pair up by the order each rank opens them,
    so this rank's next context would pair with the peers' current one and the step's
    tensors with those of the next step, every number silently off by one step. So the
    call takes the default group's next context as a failed one, on every rank (its
    failure names this rank and the call; what the peers wait for from it is poisoned),
    and this rank's next context pairs with theirs again. Nothing is spent when another
    thread has a context open on the group (the call belongs to none of this thread's).
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    pg = dist.group.WORLD
    if pg is None:
        return
    name = str(dist.distributed_c10d._get_process_group_name(pg))
    me = threading.get_ident()
    with _lock:
        if _holders.get(name) is not None:
            return
        seq = _seqs[name] = _seqs.get(name, 0) + 1
        _holders[name] = me
    rank = dist.get_rank()
    exc.args = (
        f"{exc.args[0]} (rank {rank} called it outside any context: the default group's "
        f"context {seq}, which the other ranks are in or enter next, fails with this "
        "error on every rank, so that the next contexts pair up step by step again)",
    )
    try:
        ctx = Context(next(_ids), pg, name, seq, default_seconds("timeout"), leader=leader)
        ctx.channel.post(what, describe(exc))
        ctx.poison()
        bury_sent(ctx.works)
        ctx.leave_failed()
    finally:
        with _lock:
            _holders.pop(name, None)


def leaving(name: str) -> tuple[int, int | None]:
    """As this process leaves group ``name`` (:mod:`.dist_left`): how many contexts it
    opened on it, and the one it is in (None: none)."""
    with _lock:
        seq = _seqs.get(name, 0)
        return seq, seq if name in _holders else None


class UnknownContextError(ValueError, RuntimeError):
    """A context id that names no open context of this process.

    Both a ``ValueError`` (a bad argument, as xgrad's callers catch it) and a
    ``RuntimeError`` (what PyTorch's ``torch.distributed.autograd`` raises, so code
    written for it catches this too).
    """


def find_context(context_id: int) -> Context:
    """The open context ``context_id`` names; :class:`UnknownContextError` if none."""
    ctx = OPEN.get(context_id)
    if ctx is None:
        # PyTorch's wording first, for code and people that look for it.
        raise UnknownContextError(
            f"Could not find autograd context with id: {context_id!r} (context_id="
            f"{context_id!r} is not an open distributed autograd context; open: {sorted(OPEN)})"
        )
    return ctx


# Shown in tracebacks and pickled under its public path, where it was defined before.
UnknownContextError.__module__ = "xgrad.torch_backend.dist_autograd"


def _label(step: Any) -> str | None:
    """``step`` as the label its context's tensors carry (its ``repr``: ``5`` and ``"5"``
    differ), or None; refused unless an int or a str."""
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, (int, str)):
        raise TypeError(
            f"step={step!r} must be an int or a str labelling the step the context is for "
            "(or None: no label)"
        )
    return repr(step)


@contextlib.contextmanager
def open_context(
    group: Any, timeout: float | timedelta, *, leader: bool, step: int | str | None = None
) -> Iterator[int]:
    """:func:`.dist_autograd.context` (see there); ``leader``: a pass ends through the
    group's lowest rank (else every rank tells every other)."""
    timeout = check_seconds("timeout", timeout)
    label = _label(step)
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
    dist_left.refuse(name, pg, _ids)  # (a peer that left it: raised at once)
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
        ctx = Context(next(_ids), pg, name, seq, timeout, leader=leader, step=label)
        dist_left.watch(name, pg, ctx.me, leaving)
    except BaseException:
        with _lock:
            _holders.pop(name, None)
        raise
    with _lock:
        OPEN[ctx.id] = ctx
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
        dist_left.remember(name, pg, exc)  # (a peer's leave: each later context raises it)
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
            OPEN.pop(ctx.id, None)
            _holders.pop(name, None)
        if not ok:
            bury_sent(ctx.works)
            ctx.leave_failed()
        else:  # after the exit's exchange: nothing here is posted to the peers
            release_saved(ctx.ran)
