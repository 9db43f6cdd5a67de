"""Under xgrad's ``Join`` of several DDPs: an iteration that a rank gives up in a ``no_sync`` pass.

An iteration runs each DDP's passes in the context's order: ``d1``'s ``no_sync`` pass and
``d2``'s, as many times as it accumulates, then each one's synchronised pass. A rank
whose ``no_sync`` pass of one DDP raises skips the rest of the iteration (a ``try`` per
iteration), while the other ranks still training, and the joined ranks' hooks, go on
with it until they learn of the failure (at the first DDP's next pass: a count stands
in for the step's synchronised pass, :func:`~.join_rounds.stand_in`). Before, three
things went wrong, each a wait past the timeout or the wrong error:

* the later DDPs' pass of the same micro-batch, skipped here, sends an announcement on
  its DDP's group that the others wait for (they hung). This rank now stands in for
  each such pass (:func:`skip_pass`): the collectives the pass would have sent (the step
  it begins, its announcement, a rebuild or a buffer sync that is due), without the
  module, so that every rank's steps and collectives of that DDP stay paired.
* a later DDP's failure gave up that DDP's step only: the first DDP sent no stand-in, so
  the first DDP's next pass of the others met this rank's next iteration's ("the ranks
  still training ran different forward passes", or a wait). It is now relayed to the
  first DDP's step and given up there too (:func:`give_up_iteration`); the failed DDP's
  own step is over: its next pass begins the next one with a fresh group on every rank
  (the ranks still training end its accumulation where they raise,
  :func:`~.join_rounds.read_announcement`; the joined ranks begin it at its next shadow
  pass, :mod:`.join_failed`).
* a ``no_sync`` backward pass that raised is posted at its DDP's next forward pass,
  which comes after the first DDP's next pass, where the others already waited for the
  stand-in: the first DDP's forward pass now posts its peers' first (:func:`give_up_cut_short`).

A rank that goes on with the given-up iteration (runs a later DDP's pass that was stood
in for) is refused at that pass, before it sends anything (:func:`refuse_skipped`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from xgrad.failure import Failure
from xgrad.torch_backend.ddp_buffers import first_pass_regrouped, sync_buffers
from xgrad.torch_backend.ddp_recover import (
    current_graph_task,
    give_up_cut_short_pass,
    reduces_unsynced,
    start_forward,
)
from xgrad.torch_backend.ddp_unfinished import post_failed_pass
from xgrad.torch_backend.join_rounds import announce, read_announcement
from xgrad.torch_backend.join_settle import settle_next

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["give_up_cut_short", "give_up_iteration", "linked", "refuse_skipped", "skip_pass"]


def _ddps(joinables: Sequence[Any]) -> list[Any]:
    return [j for j in joinables if hasattr(j, "_grad_hooks") and hasattr(j, "_watch")]


def linked(joinables: Sequence[Any]) -> None:
    """xgrad's ``Join`` over ``joinables``: with two DDPs or more, each one's given-up
    ``no_sync`` pass gives up the iteration (the hooks' ``give_up``, called by
    :func:`~.ddp_recover.abandon_step`)."""
    ddps = _ddps(joinables)
    for ddp in ddps:
        ddp._grad_hooks.give_up = (
            functools.partial(give_up_iteration, ddp) if len(ddps) > 1 else None
        )


def _in_context(ddp: DistributedDataParallel) -> bool:
    """Whether ``ddp`` is in an enabled xgrad ``Join`` now (its peers: that context's)."""
    config = ddp._join_config
    return bool(config.enable) and ddp._counted_config is config and bool(ddp._join_peers)


def give_up_iteration(ddp: DistributedDataParallel, failure: Failure) -> None:
    """This rank gave up its step of ``ddp`` in a ``no_sync`` pass (``failure``) and skips
    the rest of the iteration: the later DDPs' pass of this micro-batch is stood in for
    (:func:`skip_pass`), those that accumulate (judged by their last step: one whose
    accumulation varies from step to step is outside the rule); a DDP other than the first relays the failure to the first's
    step, accumulating, which gives it up in its place (its stand-in count follows at the
    first DDP's next pass, whose sum says whether a synchronised pass then is this
    step's, :func:`~.join_rounds.stand_in`)."""
    if not _in_context(ddp):
        return
    peers = _ddps(ddp._join_peers)
    index = peers.index(ddp)
    for later in peers[index + 1 :]:
        its = later._grad_hooks
        if its.accumulated is False and not its.accumulating:
            # Its last step had no no_sync pass (a DDP that accumulates nothing, its one
            # pass per iteration after the others' accumulation): the others run none of
            # it in this micro-batch, and a stand-in would meet its next real pass there,
            # an iteration later. With a rank joined, whose hooks shadow it after this
            # micro-batch's count, every rank still training stands in for it alike at
            # its next pass of the first DDP, this rank too (join_absent).
            continue
        # (a backward pass's failure is given up at the next forward pass: the pass
        # stood in for then is not the next one of that DDP's here)
        skip_pass(later, refuse=failure.where == "forward")
    first = peers[0]
    hooks = first._grad_hooks
    if first is ddp or not hooks.accumulating:
        return
    channel = first._watch.channel
    if channel.poll() is None:
        channel.relay(failure)
    hooks.accumulating = False  # the step it accumulated for is over
    hooks.given_up = channel.poll()
    ddp._grad_hooks.given_up = None  # (the first DDP's stand-in tells its next pass)


def skip_pass(ddp: DistributedDataParallel, refuse: bool = False) -> None:
    """Stand in for ``ddp``'s ``no_sync`` pass of an iteration this rank gave up: the
    collectives of its forward pass before the module, in the same order
    (:func:`~.ddp_forward.pre_forward`'s), none waited for but a rebuild's; the
    announcement is read at its next pass, or by its join hook. ``refuse``: its next
    forward pass is refused if it is this one (:func:`refuse_skipped`)."""
    hooks = ddp._grad_hooks
    if ddp._announcing is not None or ddp._watch.deferred is not None:
        settle_next(ddp)
    start_forward(ddp._watch, hooks, False, True, accumulate=True)
    first_pass_regrouped(ddp)  # as a forward pass after a failed step does
    if ddp._check_sync_bufs_pre_fwd():
        sync_buffers(ddp)
    grad = torch.is_grad_enabled()
    announce(ddp, grad, grad and not hooks.accumulating and reduces_unsynced(hooks), False)
    if grad and ddp.reducer.rebuild_due():
        read_announcement(ddp)  # before the rebuild's broadcast on the group
    if grad and ddp.reducer.rebuild_buckets():
        ddp._agreement_pending = True
        if ddp.gradient_as_bucket_view:
            hooks.alias_grads_to_buckets()
    ddp.require_forward_param_sync = False
    order = ddp._join_order
    hooks.skipped_at = order.firsts if refuse and order is not None else None
    if order is not None and ddp in order.joinables:  # its pass since the last count
        order.seen[order.joinables.index(ddp)] = order.firsts


def give_up_cut_short(ddp: DistributedDataParallel) -> None:
    """Before ``ddp``'s forward pass: a DDP of its context whose backward pass raised (cut
    short, not posted yet: that DDP's next forward pass would) has it posted now, before
    this pass sends anything: another DDP's, and this one's own. A ``no_sync`` pass gives
    its iteration up, whose stand-ins for the later DDPs (:func:`skip_pass`) then come
    before this pass's count, where the others meet them, and tell it which ones it need
    not stand in for; a synchronised one (with several DDPs) is posted, so that this
    pass does not stand in for the later DDPs either, as the joined ranks, which learn of
    it in that pass's round, do not shadow them (:mod:`.join_absent`: before, this rank
    waited in its stand-in while the others waited for its part of the round, to the
    timeout)."""
    if not _in_context(ddp) or current_graph_task() != -1:
        return
    peers = _ddps(ddp._join_peers)
    for peer in peers:
        hooks = peer._grad_hooks
        if hooks.nosync_open:
            give_up_cut_short_pass(peer._watch, hooks)
        elif hooks.finalize_queued and len(peers) > 1:
            if peer._announcing is not None or peer._watch.deferred is not None:
                settle_next(peer)  # first, as its next pass does: a failure here, not raised
            post_failed_pass(hooks, peer._watch)


def refuse_skipped(ddp: DistributedDataParallel) -> None:
    """Before ``ddp``'s forward pass: refused if it is the pass :func:`skip_pass` stood in
    for (no forward pass of the context's first DDP since): the iteration was given up
    here, and the others paired that pass's collectives with the stand-in's already."""
    hooks = ddp._grad_hooks
    skipped, hooks.skipped_at = hooks.skipped_at, None
    order = ddp._join_order
    if skipped is None or order is None or order.firsts != skipped:
        return
    index = order.joinables.index(ddp)
    raise RuntimeError(
        f"join(): rank {ddp._watch.channel.rank} ran a forward pass of DDP {index} of the "
        "join context (its joinables counted from 0) in an iteration it gave up at a "
        "no_sync pass that raised: with several DDPs in xgrad's Join, such a failure ends "
        "the iteration on that rank, and that pass was sent for already (the other ranks "
        "are past it). Catch the failure around the whole iteration (a try per step)"
    )
