"""A DDP step begun after a failed one, or given up: the reducer's part dropped, the peers told.

What :func:`~.ddp_recover.start_forward` (a forward pass, or a joined rank's shadow of one)
calls as a step begins (:func:`begin_next_step`, which drops what the failed step left:
:func:`recover`), and what a rank that gives up the step it is in or accumulates for does
(:func:`abandon_step`; a ``no_sync`` backward pass that raised part-way:
:func:`give_up_cut_short_pass`). Kept apart from the forward pass's own decisions
(:mod:`.ddp_recover`, which re-exports these).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from xgrad.callers import user_stacklevel
from xgrad.failure import FailureChannel
from xgrad.torch_backend.ddp_leftovers import given_up_key, mark_next
from xgrad.torch_backend.ddp_unfinished import (
    DROPPED,
    UNFINISHED,
    post_failed_pass,
    post_failed_passes,
)
from xgrad.torch_backend.ddp_which_step import post_count

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp_failure import StepWatch
    from xgrad.torch_backend.ddp_hooks import GradientHooks

__all__ = [
    "abandon_step",
    "begin_next_step",
    "give_up_cut_short_pass",
    "post_cut_short_pass",
    "recover",
]

#: what a ``no_sync`` pass cut short is posted as when its exception was not seen.
_NOSYNC_CUT_SHORT = "RuntimeError: a no_sync backward pass raised an exception"


def give_up_cut_short_pass(watch: StepWatch, hooks: GradientHooks) -> None:
    """A ``no_sync`` backward pass raised part-way (its end never ran, and no backward
    call is under way): its step is given up, and the peers, which would pair its
    collectives with this rank's next step's (silently wrong gradients), raise it there,
    with its text where noted (:mod:`.ddp_cut_short`)."""
    hooks.nosync_open = False
    UNFINISHED.discard(hooks)
    cause, hooks.cut_short = hooks.cut_short, None
    error = abandon_step(watch, hooks, "backward", cause or _NOSYNC_CUT_SHORT, until_sync=True)
    if error is not None:
        warnings.warn(
            f"DistributedDataParallel (rank {watch.channel.rank}): {error}; the step it "
            "accumulated for is given up on every rank",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )


def post_cut_short_pass(watch: StepWatch, hooks: GradientHooks) -> None:
    """A backward pass of this rank's cut short and not posted yet (no backward call under
    way): a ``no_sync`` one gives up its step (:func:`give_up_cut_short_pass`), a
    synchronised one is posted to it (:func:`.ddp_unfinished.post_failed_pass`)."""
    if hooks.nosync_open:
        give_up_cut_short_pass(watch, hooks)
    elif hooks.finalize_queued:
        post_failed_pass(hooks, watch)


def begin_next_step(
    watch: StepWatch,
    hooks: GradientHooks,
    joining: bool = False,
    gate: Callable[[FailureChannel], None] | None = None,
    hold_read: bool = False,
) -> None:
    """Begin the next synchronised step; after a failed one, drop this rank's part of it,
    and what the reducer learned in it (every rank learns it again alike). A join round
    still open in the failed step (no backward pass began here) is entered with ``FAIL``
    first, before the fresh group (:meth:`~.join_rounds.OpenRound.fail`). Under
    ``join()`` this rank then marks that it makes the fresh group (:func:`mark_next`);
    ``gate`` (a joined rank's, ahead of the others) may wait for their marks, or raise.
    ``hold_read``: :meth:`~.ddp_failure.StepWatch.begin_step`'s (a step given up in a
    ``no_sync`` pass whose next pass is being placed, :mod:`.ddp_which_step`)."""
    failing = watch.channel.poll() is not None
    pending = hooks.join_round
    if pending is not None and failing:
        hooks.join_round = None
        pending.fail()
    if failing:
        post_count(watch)
    watch.nosync_passes = 0
    if failing and joining:
        mark_next(watch)
        if gate is not None:
            gate(watch.channel)
    # (polled: the poll above, one round trip a step)
    failed = watch.begin_step(polled=True, hold_read=hold_read)
    reducer = hooks.reducer
    assert reducer is not None
    if failed is not None:
        reducer.fail(failed.text())
        recover(
            hooks, watch, also=f"reductions moved to a fresh process group after {failed.text()}"
        )
        if hooks.step_state is not None:
            reducer.restore_step_state(hooks.step_state)
    hooks.step_state = reducer.step_state()


def recover(hooks: GradientHooks, watch: StepWatch, also: str = "") -> None:
    """At a forward pass: drop a backward pass that failed part-way, with a warning.

    A pass whose final callback never ran was cut short by an exception (in a hook,
    a comm hook, autograd): that is posted to the step's failure channel (peers still
    waiting for this rank's buckets stop at once) and the pass marked failed. The
    reducer then starts clean instead of blaming unused parameters for the
    gradients that never came.
    """
    reducer = hooks.reducer
    assert reducer is not None
    if UNFINISHED or DROPPED:
        post_failed_passes(hooks)
    rank = watch.channel.rank  # the global rank, as the failures name them
    if hooks.arrivals.log:
        # Logged gradients of a pass no Python hook saw: marked now, so an unfinished
        # reduction is reported by the next prepare_for_backward.
        hooks.drain()
    post_failed_pass(hooks, watch)
    dropped = reducer.recover()
    if dropped is not None or also:
        hooks.buffer_futures.clear()  # the failed step's buffer hook: not waited for
    # Only a pass cut short leaves .grad to fix. A step that failed in a forward pass (a
    # bad batch skipped with ``except``) raised on every rank already: no warning more.
    if dropped is not None:
        warnings.warn(
            f"DistributedDataParallel (rank {rank}): "
            + "; ".join(x for x in (dropped, also) if x)
            + "; .grad holds this rank's unreduced gradients of that pass: zero them "
            "before the next step",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )


def abandon_step(
    watch: StepWatch,
    hooks: GradientHooks,
    where: str,
    exc: BaseException | str,
    unbegun: bool = False,
    *,
    until_sync: bool = False,
) -> Any:
    """This rank gave up the synchronised step it was in or accumulating for (a pipeline
    step that failed around the DDP; a ``no_sync`` forward pass that raised): the DDP's
    peers, which wait or will wait in that step's collectives, are told at once; the
    error is returned (``None`` where there was nothing to give up).

    A synchronised pass begun and not finished is posted as at a forward pass
    (:func:`.ddp_unfinished.post_failed_pass`). A rank that only accumulated (``no_sync`` passes since
    its last synchronised step, which began that step) posts the failure to it: the
    peers raise it in that step's collectives, instead of pairing them with this rank's
    next step (silently wrong gradients), and every rank replaces the private group at
    the step after it. ``unbegun``: the caller's step (a pipeline step) failed before this
    rank's DDP began the step its peers are in: begun now, then posted. ``until_sync``: a
    pass of the user's accumulation raised, and the peers go on to the step's synchronised
    pass: when this rank's next pass is that synchronised one, the step ends there, raising
    the failure again, so that the ranks' next steps pair up (:func:`start_forward`; a
    ``no_sync`` pass next is placed in a step at the synchronised pass after it,
    :mod:`.ddp_which_step`). Otherwise the step is over now (a pipeline's: every rank
    gave it up). ``exc`` may be an exception's noted ``"Type: text"`` (a ``no_sync`` pass
    cut short in autograd).

    A rank whose synchronised forward pass of the step ran and whose backward never
    began (a pipeline step that failed in between) posts the failure too, and drops the
    pass the reducer was prepared for: left so, every replica's stage could be in that
    state at once, and the reducer, still expecting, took the next ``no_sync`` backward
    pass for the given-up one ("prior iteration" error on every rank).
    """
    if hooks.finalize_queued:
        post_failed_pass(hooks, watch)
        return None
    if unbegun:
        begin_next_step(watch, hooks)
    elif hooks.sync_pending and not until_sync:
        hooks.sync_pending = False  # no skip round: the step failed, and is posted
        assert hooks.reducer is not None
        hooks.reducer.drop_prepared()
        return watch.post_here(where, exc)
    elif not hooks.accumulating:
        return None
    hooks.accumulating = False  # the step (begun at the accumulation's first pass) is over
    error = watch.post_here(where, exc)
    if until_sync:
        hooks.given_up = error.failure
        if hooks.give_up is not None:  # the other DDPs of an xgrad Join (join_given_up)
            hooks.give_up(error.failure)
    elif hooks.joining():
        # Given up whole (a pipeline step), no stand-in count follows: the joined ranks
        # begin the next step at once instead of waiting for one (join_failed).
        watch.channel.store.set(given_up_key(watch.channel.prefix), b"1")
    return error
