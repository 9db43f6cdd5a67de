"""A rank that leaves a DDP's group tells its peers: what it left unfinished, or that it left.

A backward pass that raised is posted to its step's failure channel as the exception
leaves autograd outside ``join()`` (:mod:`.ddp_cut_short`), under xgrad's ``join()`` as
the rank joins or an exception leaves the block (:mod:`.join`), and else at the rank's
next forward pass (:mod:`.ddp_unfinished`). A rank with no forward pass after it whose
process then ended, or that destroyed the group, left its peers waiting in the step's
synchronised pass until its connections closed, and they named it as one that "stopped
answering", not its exception: a pass under PyTorch's own ``Join`` (none of xgrad's hooks
runs as it is left), or a DDP collected with its step under way
(:data:`~.ddp_unfinished.DROPPED`). So did a rank that left with nothing unfinished while
its peers went on (inputs of different lengths without ``join()``: they waited in the
next iteration's collectives for a rank that had ended), and one that left in the middle
of an accumulation, or after a forward pass whose backward never came.

So, as the process destroys a DDP's group or ends (:mod:`.leaving`'s hooks, asked for
with the first DDP's, which run before the group's connections close and before the
heartbeats stop, so a peer whose transfer fails then finds the post), each of its DDPs on
that group posts what it left unfinished, as :func:`.ddp_recover.start_forward` would
have, or else a note that it left (kind ``"unresponsive"``, as :mod:`.dist_left`'s), in
the step its peers would wait for it in: "rank 1: left after 2 iterations of the DDP
(its process ended): it never runs iteration 3 ...". Where every rank ends alike, no one
reads it. It never raises: a group destroyed or aborted already is skipped (its peers
were told then, or gave up on it), each store call is bounded (two seconds, as
:mod:`.dist_left`'s), and a store gone already answers nothing (the peers then name this
rank by its heartbeat, as before). Nothing is paid per step: one post per DDP as the
process leaves. A rank killed or frozen runs no hook and is still named by its heartbeat.

As the process ends or destroys every group, last, it also closes the connections of
each private group a wait of its DDPs left with a collective pending after a failure
(:data:`.ddp_waits.ABANDONED`: a peer's post, raised at once, while this rank's part of a
bucket's all-reduce was still out; every rank makes a fresh group after a failed step,
so no one uses it again). Left so, gloo aborted the process at exit when the peer closed
its end ("terminate called after throwing an instance of 'gloo::IoException'"), whether
the script destroyed the group or not (destroyed, the group object lives on with its
collective); closed here, the collective fails in its own thread, and the process ends
with its own exit code.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from xgrad.failure import FailureChannel
from xgrad.torch_backend.ddp_cut_short import HOOKS
from xgrad.torch_backend.ddp_give_up import post_cut_short_pass
from xgrad.torch_backend.ddp_unfinished import DROPPED, UNFINISHED
from xgrad.torch_backend.ddp_waits import ABANDONED
from xgrad.torch_backend.dist_watch import sever
from xgrad.torch_backend.failure import EXIT_WAIT, guarded_store
from xgrad.torch_backend.leaving import alive, every_group, how_left, on_leave

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp_failure import StepWatch

__all__ = ["GONE", "collected", "install", "post_left_unfinished"]

#: the DDPs of this process collected with no step under way here: (their group, the
#: failure channel prefix of the step after their last, that last step); on a group
#: still alive, the last :data:`GONE_KEPT` of each group.
GONE: list[tuple[Any, str, int]] = []
#: how many collected DDPs of one group :data:`GONE` keeps: a loop that makes and drops
#: DDPs without end (trials, retries) keeps a few notes, not one per DDP, each a store
#: write at exit. A peer still in an older one's step is named by its heartbeat then.
GONE_KEPT = 8


def install() -> None:
    """Post what this process's DDPs leave unfinished as it leaves their groups (a
    lookup after the first call)."""
    on_leave(post_left_unfinished)


def collected(watch: StepWatch) -> None:
    """``watch``'s DDP was collected with no step under way on this rank: where its next
    step's note goes is kept (not the watch, whose private group would stay alive).
    Those of a destroyed group go (no one reads them), and past :data:`GONE_KEPT` of
    one group the oldest."""
    group = watch.user_group
    GONE[:] = [gone for gone in GONE if alive(gone[0])]
    GONE.append((group, watch.channel_of(watch.step + 1).prefix, watch.step))
    same = [gone for gone in GONE if gone[0] is group]
    if len(same) > GONE_KEPT:
        GONE.remove(same[0])


def post_left_unfinished(group: Any = None, exiting: bool = True) -> None:
    """This process leaves ``group`` (``None``: every group) and runs no pass there any
    more: each DDP of it on that group tells its peers (:func:`_post_leave`), and so does
    each one collected (with a step under way here: :data:`~.ddp_unfinished.DROPPED`;
    else :data:`GONE`). ``exiting``: :data:`.leaving.Leave`'s."""
    every = every_group(group)
    how = how_left(exiting)

    def ours(pg: Any) -> bool:
        return every or pg is group

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (post_cut_short_pass's: no one reads it now)
        for dropped in [w for w in DROPPED if ours(w.user_group)]:
            DROPPED.remove(dropped)  # (collected in a step: the note says which)
            pg, prefix = dropped.user_group, dropped.channel.prefix
            _safely(pg, _note, pg, prefix, _inside(dropped.step, how))
        for hooks in list(HOOKS):
            watch = getattr(hooks, "watch", None)
            if watch is not None and ours(watch.user_group):
                _safely(watch.user_group, _post_leave, watch, hooks, how)
        for gone in [g for g in GONE if ours(g[0])]:
            GONE.remove(gone)
            pg, prefix, step = gone
            _safely(pg, _note, pg, prefix, _after(step, how))
    if every:  # last: a peer whose wait then fails finds the posts
        while ABANDONED:
            _safely(ABANDONED[-1], _sever, ABANDONED.pop())


def _sever(group: Any) -> None:
    """Close ``group``'s connections (a receive that times out at once): its collective
    left pending then fails here, before the interpreter finalizes, not in gloo's thread
    as a peer closes its end (which aborted the process)."""
    if group.size() > 1:
        sever(group, (group.rank() + 1) % group.size())


def _post_leave(watch: StepWatch, hooks: Any, how: str) -> None:
    """Tell ``watch``'s peers that this rank left (``how``): a pass it left unfinished is
    posted to its step, as its next forward pass would have; else the step its peers
    would wait for it in gets a note that it left (an accumulation or a forward pass
    awaiting its backward: the step it is in; else the next one)."""
    pg = watch.user_group
    if hooks in UNFINISHED and (hooks.nosync_open or hooks.finalize_queued):
        watch.channel.store = guarded_store(pg, timeout=EXIT_WAIT)  # (as _note's)
        post_cut_short_pass(watch, hooks)
    elif hooks.accumulating or hooks.sync_pending:
        _note(pg, watch.channel.prefix, _inside(watch.step, how))
    else:
        _note(pg, watch.channel_of(watch.step + 1).prefix, _after(watch.step, how))


def _safely(group: Any, post: Callable[..., None], *args: Any) -> None:
    """``post(*args)``, if c10d still knows ``group``; never raises (leaving goes on)."""
    if alive(group):
        with contextlib.suppress(Exception):
            post(*args)


def _note(group: Any, prefix: str, message: str) -> None:
    """Post ``message`` (this rank left) to the failure channel ``prefix`` of ``group``,
    of kind ``"unresponsive"``, each store call bounded (as :mod:`.dist_left`'s post: a
    store host frozen holds no exit long)."""
    store = guarded_store(group, timeout=EXIT_WAIT)
    FailureChannel(store, prefix, dist.get_rank()).post("", message, kind="unresponsive")


def _inside(step: int, how: str) -> str:
    """The note of a rank that left (``how``) in iteration ``step`` of a DDP."""
    return (
        f"left in iteration {step} of the DDP ({how}), before its synchronised backward "
        "pass, in which the other ranks wait for it"
    )


def _after(step: int, how: str) -> str:
    """The note of a rank that left (``how``) after ``step`` iterations of a DDP."""
    return (
        f"left after {step} iterations of the DDP ({how}): it never runs iteration "
        f"{step + 1}, in which the other ranks wait for it (every rank runs as many "
        "iterations as the others: inputs of different lengths need ddp.join())"
    )
