"""The DDP passes of this process left unfinished, and the dropped DDPs, told to the peers.

A backward pass cut short (synchronised or ``no_sync``) or a DDP collected with its step
under way leaves peers waiting in that step's collectives. Kept apart from the recovery
at the DDP's own next forward pass (:mod:`.ddp_recover`) because other code posts them
too: the gradient hooks and the end of a pass keep :data:`UNFINISHED` and
:data:`DROPPED`, the pipeline and a new DDP's construction post them before their own
collectives (:func:`post_failed_passes`, :func:`before_wrapping`), so that no rank
waits in one DDP's collectives while its peers wait in another's.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

import torch

from xgrad.torch_backend.weak_hooks import collect_dropped

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp_failure import StepWatch
    from xgrad.torch_backend.ddp_hooks import GradientHooks

__all__ = [
    "DROPPED",
    "UNFINISHED",
    "before_wrapping",
    "post_failed_pass",
    "post_failed_passes",
]

current_graph_task = torch._C._current_graph_task_id

#: what a synchronised pass cut short is posted as when its exception was not seen.
_CUT_SHORT = "RuntimeError: the backward pass raised an exception"

#: the DDPs of this process whose backward pass (synchronised or ``no_sync``) has begun
#: and not finished (empty between good steps): one left here failed part-way. Held
#: strongly: a failed DDP that the user dropped (a retry loop that wraps the module
#: again) still tells its peers at the next forward pass or DDP made here, and is freed
#: then.
UNFINISHED: set[GradientHooks] = set()

#: the step watches of DDPs collected with a step under way on this rank (a forward pass
#: whose backward never came, ``no_sync`` passes begun): the peers may wait in that
#: step's collectives. Posted at the next forward pass, pipeline step or DDP made here
#: (:func:`post_failed_passes`), not by the collector, which runs wherever it is.
DROPPED: list[StepWatch] = []


def post_failed_pass(hooks: GradientHooks, watch: StepWatch) -> None:
    """If the last synchronised backward pass began and never finished (autograd raised
    part-way), post that to its step's failure channel: the peers waiting for this
    rank's buckets stop at once, naming it. The reducer drops the pass at
    :func:`.ddp_recover.recover`."""
    if hooks.finalize_queued:
        hooks.finalize_queued = False
        hooks.sync_pending = False  # a pass noted before its first hook (ddp_cut_short)
        UNFINISHED.discard(hooks)
        # What raised, as the peers hear a forward pass's or a comm hook's failure; the
        # generic words where it was not seen leaving autograd (:mod:`.ddp_cut_short`).
        cause, hooks.cut_short = hooks.cut_short, None
        failure = watch.channel.post("backward", cause or _CUT_SHORT)
        assert hooks.reducer is not None
        hooks.reducer.fail(failure.text())


def post_failed_passes(current: GradientHooks | None) -> None:
    """At a forward pass of ``current``: post the failed backward passes of the other DDPs.

    A rank whose backward pass of one DDP raised (a user's hook, autograd) and that goes
    on with another DDP would otherwise post the failure only at the failed DDP's next
    forward pass, while its peers wait for its buckets and it waits for them in the
    other DDP's collectives: both until a timeout. Only the passes begun from this thread
    are looked at, and only outside any backward pass (a forward pass run by a hook or by
    checkpointing's recomputation is part of a pass still under way).
    """
    if current_graph_task() != -1:
        return
    while DROPPED:
        # A dropped DDP's step: its peers stop now, naming this rank, as for a pass that
        # raised (a rank that dropped it too waits for nothing there any more). Best
        # effort: a store gone since (its group destroyed) fails nothing of this pass.
        watch = DROPPED.pop()
        with contextlib.suppress(Exception):
            watch.post(
                "backward",
                RuntimeError("the DDP was dropped before its step's backward pass ran here"),
            )
    me = threading.get_ident()
    for hooks in list(UNFINISHED):
        if hooks is not current and hooks.forward_thread == me:  # current None: every one
            post_failed_pass(hooks, hooks.watch)


def before_wrapping() -> None:
    """At a DDP's construction, before its collectives: a retry loop that wraps the module
    again after a failed step tells the peers of the failed DDP now (they wait in its
    collectives while this rank would wait in the new one's, both to a timeout), and the
    hooks of a DDP it dropped leave the parameters before the new DDP's are added (they
    would run in its backward pass, with the dropped one's reductions and failures)."""
    if UNFINISHED:
        post_failed_passes(None)  # a failed DDP's: told, then no longer kept for it
        # A failed no_sync pass is posted at its DDP's next forward (its text kept on it):
        # not held here, so a dropped one is collected below and its step posted.
        UNFINISHED.difference_update([h for h in UNFINISHED if not h.finalize_queued])
    collect_dropped()
    if DROPPED:
        post_failed_passes(None)  # a step under way on a DDP collected just now
