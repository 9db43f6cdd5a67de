"""A backward pass cut short, dropped at the next forward pass on every rank alike.

Separate from the gradient hooks (:mod:`.ddp_hooks`), which feed the reducer on a pass
that runs to its end: this is what happens after one did not (a hook, a comm hook or
autograd raised part-way). The failure is posted to the step's channel so that peers
waiting for this rank's buckets stop at once, the reducer drops the pass, and a step that
failed anywhere moves the reductions to a fresh private group (:mod:`.ddp_failure`).
The passes left unfinished are kept and posted by :mod:`.ddp_unfinished` (the names that
the pipeline takes from here are re-exported).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from xgrad.callers import user_stacklevel
from xgrad.failure import FailureChannel, error_for
from xgrad.torch_backend.ddp_leftovers import mark_next
from xgrad.torch_backend.ddp_skipped import settle_skipped
from xgrad.torch_backend.ddp_unfinished import DROPPED as DROPPED
from xgrad.torch_backend.ddp_unfinished import UNFINISHED as UNFINISHED
from xgrad.torch_backend.ddp_unfinished import post_failed_pass
from xgrad.torch_backend.ddp_unfinished import post_failed_passes as post_failed_passes

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp_failure import StepWatch
    from xgrad.torch_backend.ddp_hooks import GradientHooks

__all__ = [
    "DROPPED",
    "UNFINISHED",
    "abandon_step",
    "drop_unreduced",
    "post_failed_passes",
    "recover",
    "reduces_unsynced",
    "start_forward",
]

#: what a ``no_sync`` pass cut short is posted as when its exception was not seen.
_NOSYNC_CUT_SHORT = "RuntimeError: a no_sync backward pass raised an exception"

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
    recomputed ones, are for the next synchronised step). ``gate``: :func:`_begin_step`'s.
    """
    if (
        hooks.sync_pending
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
        # A no_sync backward pass raised part-way: its step is given up, and the peers,
        # which would pair its collectives with this rank's next step's (silently wrong
        # gradients), raise it there, with its text where noted (:mod:`.ddp_cut_short`).
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
        # step (the loop skipped the rest of the failed step, a try per step).
        raise error_for(failure, watch.channel.rank)
    if not sync:
        # A no_sync pass accumulates for the next synchronised step, which begins at the
        # accumulation's first pass on every rank alike: its collectives (a rebuild, a
        # buffer sync) and a failure in it are then that step's, where the peers look.
        if accumulate and not hooks.accumulating:
            _begin_step(watch, hooks, joining)
            # Still prepared (a synchronised forward pass every rank left without a
            # backward: the skip round found no failure), the reducer takes this pass's
            # gradients as PyTorch's does: reduced, a step of its own (post_forward).
            hooks.accumulating = not (torch.is_grad_enabled() and reduces_unsynced(hooks))
        elif joining and not accumulate and watch.channel.poll() is not None:
            # Under join(), the first pass after a failed step begins the next, whatever
            # its kind (an evaluation too): a rank that has joined cannot know which pass
            # comes, and begins it with its fresh group as soon as it sees the failure
            # (join_hook), as a rank that leaves join() does.
            _begin_step(watch, hooks, joining)
        watch.current_group()  # a lost group raises its failure again
        return
    if hooks.accumulating:  # begun at the accumulation's first pass
        hooks.accumulating = False
        return
    _begin_step(watch, hooks, joining, gate)


def reduces_unsynced(hooks: GradientHooks) -> bool:
    """Whether a ``no_sync`` pass starting now is reduced as a synchronised one.

    PyTorch's reducer, prepared by a synchronised forward pass whose backward never ran
    (a validation loss computed with gradients on, legal when every rank does it), still
    expects hooks: the next backward pass, ``no_sync`` or not, marks its gradients ready,
    reduces them (the accumulated ``.grad``) and finalizes; later ``no_sync`` passes stay
    local. With peers (and no ``join()``), xgrad's reducer is left prepared only where
    the skip round (:mod:`.ddp_skipped`) found that every rank skipped alike (one rank's
    skip fails the step, and the reducer drops the pass at :func:`_begin_step`), so the
    ranks' next passes reduce together, in a step of their own: the skipped one's
    namespace holds every rank's skip notice, which a waiting peer would take for a
    failure. Not during a synchronised backward pass (a forward pass that a checkpoint's
    recomputation runs there).
    """
    reducer = hooks.reducer
    assert reducer is not None
    return reducer.expecting and not hooks.finalize_queued


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


def _begin_step(
    watch: StepWatch,
    hooks: GradientHooks,
    joining: bool = False,
    gate: Callable[[FailureChannel], None] | None = None,
) -> None:
    """Begin the next synchronised step; after a failed one, drop this rank's part of it,
    and what the reducer learned in it (every rank learns it again alike). A join round
    still open in the failed step (no backward pass began here) is entered with ``FAIL``
    first, before the fresh group (:meth:`~.join_rounds.OpenRound.fail`). Under
    ``join()`` this rank then marks that it makes the fresh group (:func:`mark_next`);
    ``gate`` (a joined rank's, ahead of the others) may wait for their marks, or raise."""
    failing = watch.channel.poll() is not None
    pending = hooks.join_round
    if pending is not None and failing:
        hooks.join_round = None
        pending.fail()
    if failing and joining:
        mark_next(watch)
        if gate is not None:
            gate(watch.channel)
    failed = watch.begin_step()
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
    the failure again, so that the ranks' next steps pair up (:func:`start_forward`).
    Otherwise the step is over now (a pipeline's: every rank gave it up). ``exc`` may be
    an exception's noted ``"Type: text"`` (a ``no_sync`` pass cut short in autograd).

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
        _begin_step(watch, hooks)
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
    return error
