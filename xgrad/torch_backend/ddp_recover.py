"""A backward pass cut short, dropped at the next forward pass on every rank alike.

Separate from the gradient hooks (:mod:`.ddp_hooks`), which feed the reducer on a pass
that runs to its end: this is what happens after one did not (a hook, a comm hook or
autograd raised part-way). The failure is posted to the step's channel so that peers
waiting for this rank's buckets stop at once, the reducer drops the pass, and a step that
failed anywhere moves the reductions to a fresh private group (:mod:`.ddp_failure`).
The passes left unfinished are kept and posted by :mod:`.ddp_unfinished` (the names that
the pipeline takes from here are re-exported); a step begun after a failed one, or given
up, is :mod:`.ddp_give_up`'s (re-exported).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from xgrad.failure import FailureChannel, error_for
from xgrad.torch_backend.ddp_give_up import abandon_step as abandon_step
from xgrad.torch_backend.ddp_give_up import begin_next_step, recover
from xgrad.torch_backend.ddp_give_up import give_up_cut_short_pass as give_up_cut_short_pass
from xgrad.torch_backend.ddp_pass_end import UNREDUCED
from xgrad.torch_backend.ddp_skipped import settle_skipped
from xgrad.torch_backend.ddp_unfinished import DROPPED as DROPPED
from xgrad.torch_backend.ddp_unfinished import UNFINISHED as UNFINISHED
from xgrad.torch_backend.ddp_unfinished import post_failed_passes as post_failed_passes
from xgrad.torch_backend.ddp_which_step import defer, release, settle

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp_failure import StepWatch
    from xgrad.torch_backend.ddp_hooks import GradientHooks

__all__ = [
    "DROPPED",
    "UNFINISHED",
    "abandon_step",
    "drop_unreduced",
    "give_up_cut_short_pass",
    "post_failed_passes",
    "raise_as_the_deferring",
    "recover",
    "reduces_unsynced",
    "start_forward",
]

current_graph_task = torch._C._current_graph_task_id


def start_forward(
    watch: StepWatch,
    hooks: GradientHooks,
    sync: bool,
    joining: bool,
    accumulate: bool = False,
    gate: Callable[[FailureChannel], None] | None = None,
) -> None:
    """At a forward pass: drop what a failed step left behind, on every rank alike.

    ``hooks`` (the DDP's gradient hooks) drops a backward pass this rank saw fail;
    a synchronised pass also starts a new step, and when the previous one failed
    anywhere (seen in its namespace, the same on every rank) drops this rank's part
    of it too, with a warning, and replaces the private group. A synchronised step
    whose backward never reached DDP here is settled with the peers first
    (:mod:`.ddp_skipped`; not under ``join()``, whose joined ranks run no forward).
    ``accumulate``: a pass under ``no_sync`` (its gradients, or a checkpointed pass's
    recomputed ones, are for the next synchronised step). ``gate``: :func:`~.ddp_give_up.begin_next_step`'s.
    """
    if (
        hooks.sync_pending
        and not hooks.finalize_queued  # noted cut short at its start: posted (recover)
        and watch.settled != watch.step
        and watch.world > 1
        and not joining
        and not hooks.arrivals.log
    ):
        watch.settled = watch.step
        settle_skipped(watch)
        # Settled: a no_sync pass next (gradient accumulation, a pipeline's microbatches)
        # begins the next step with no backward pending, instead of settling that step
        # too and waiting out the timeout for peers that skipped nothing there.
        hooks.sync_pending = False
    if hooks.nosync_open and current_graph_task() == -1:
        give_up_cut_short_pass(watch, hooks)
    recover(hooks, watch)
    failure, hooks.given_up = hooks.given_up, None
    if failure is not None and joining and hooks.stand_in is not None and not hooks.stand_in(sync):
        failure = None  # a later step's synchronised pass (join_rounds.stand_in)
    if failure is not None and sync:
        # The first pass after a no_sync pass that raised is the synchronised one: the
        # loop went on with the given-up step (a try per micro-batch), whose synchronised
        # pass the peers raise the failure in. So does this rank, instead of beginning the
        # next step there, one pass early (each later step then paired with the peers'
        # next one: silently wrong gradients). A no_sync pass after it begins the next
        # step (the loop skipped the rest of the failed step, a try per step) or goes on
        # with the failed one (a try per micro-batch): deferred to the next synchronised
        # pass, which settles which (ddp_which_step).
        raise error_for(failure, watch.channel.rank)
    if sync and hooks.given_up_step is not None:
        if joining:  # join()'s rounds place the pass
            release(watch, hooks)
        else:
            settle(watch, hooks)  # may raise: the failed step's synchronised pass
    if not sync:
        # A no_sync pass accumulates for the next synchronised step, which begins at the
        # accumulation's first pass on every rank alike: its collectives (a rebuild, a
        # buffer sync) and a failure in it are then that step's, where the peers look.
        if accumulate and not hooks.accumulating:
            deferred = None if joining else failure
            if deferred is not None:
                # the given-up step's next micro-batch, or the next step's first: the
                # next synchronised pass tells (ddp_which_step)
                defer(watch, hooks, deferred)
            begin_next_step(watch, hooks, joining, gate, hold_read=deferred is not None)
            # Still prepared (a synchronised forward pass every rank left without a
            # backward: the skip round found no failure), the reducer takes this pass's
            # gradients as PyTorch's does: reduced, a step of its own (post_forward).
            hooks.accumulating = not (torch.is_grad_enabled() and reduces_unsynced(hooks))
        elif joining and not accumulate and watch.channel.poll() is not None:
            # Under join(), the first pass after a failed step begins the next, whatever
            # its kind (an evaluation too): a rank that has joined cannot know which pass
            # comes, and begins it with its fresh group as soon as it sees the failure
            # (join_hook), as a rank that leaves join() does.
            begin_next_step(watch, hooks, joining, gate)
        if accumulate:
            watch.nosync_passes += 1
        if torch.is_grad_enabled():
            # A lost group raises its failure again (a rank still dead: its error, not a
            # hang). Not an evaluation under no_grad, which communicates nothing unless
            # it syncs buffers or counts for join(), each through the watched group (its
            # failure then); a rank whose peer died evaluates alone, as under PyTorch's.
            watch.current_group()
        return
    if hooks.accumulating:  # begun at the accumulation's first pass
        hooks.accumulating = False
        hooks.accumulated = True
        return
    begin_next_step(watch, hooks, joining, gate)
    hooks.accumulated = False


def reduces_unsynced(hooks: GradientHooks) -> bool:
    """Whether a ``no_sync`` pass starting now is reduced as a synchronised one.

    PyTorch's reducer, prepared by a synchronised forward pass whose backward never ran
    (a validation loss computed with gradients on, legal when every rank does it), still
    expects hooks: the next backward pass, ``no_sync`` or not, marks its gradients ready,
    reduces them (the accumulated ``.grad``) and finalizes; later ``no_sync`` passes stay
    local. With peers (and no ``join()``), xgrad's reducer is left prepared only where
    the skip round (:mod:`.ddp_skipped`) found that every rank skipped alike (one rank's
    skip fails the step, and the reducer drops the pass at :func:`~.ddp_give_up.begin_next_step`), so the
    ranks' next passes reduce together, in a step of their own: the skipped one's
    namespace holds every rank's skip notice, which a waiting peer would take for a
    failure. Not during a synchronised backward pass (a forward pass that a checkpoint's
    recomputation runs there).
    """
    reducer = hooks.reducer
    assert reducer is not None
    return reducer.expecting and not hooks.finalize_queued


def raise_as_the_deferring(watch: StepWatch, step: int, joining: bool) -> None:
    """After the forward pass's start: where it began the step after one whose first
    failure was a pass left unreduced, raise that failure here too, as the ranks that
    deferred it raise it here (:func:`drop_unreduced`).

    Such a step can fail differently on two ranks: the one whose gradients never came
    defers its error to this forward pass (PyTorch's "prior iteration" error), while a
    peer that raised in that step's backward pass itself (its own error, a static graph
    whose graph changed) began this step clean. Their loops were then a step apart for
    good: this rank's next step paired with the deferring rank's step after, without a
    word, and the last step waited out the timeout. Not under ``join()``, whose rounds
    place the passes (:mod:`.ddp_which_step`).
    """
    failed = watch.ended_failed
    if joining or watch.step == step or failed is None or failed.where != UNREDUCED:
        return
    watch.raised_at = watch.step  # in the step begun now, as the deferring ranks' (join_leave)
    raise error_for(failed, watch.channel.rank)


def drop_unreduced(hooks: GradientHooks, start: Callable[[], None]) -> RuntimeError | None:
    """If the last pass left buckets unreduced (``hooks.unfinished``), drop that step now
    with ``start`` (the forward pass's :func:`start_forward`) and return its error to
    raise; else None.

    Every rank does this at the same point (the forward pass where it raises, or a joined
    rank's count of the ranks still training), so the fresh group the dropped step needs
    is made by all; its warning is not given, the error says it.
    """
    error, hooks.unfinished = hooks.unfinished, None
    if error is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            start()
    return error
