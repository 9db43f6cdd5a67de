"""A joined rank's side of a step that failed under ``join()``: kept, the next step begun.

The failed-step half of :class:`~.join_hook.DDPJoinHook` (a mixin it takes its
methods from): a step that failed anywhere (a rank still training's pass, a ``no_sync``
pass this rank shadowed, this rank's own last pass) is kept, to raise when ``join()``
ends, and the next step is begun with its fresh group where the ranks still training
begin it (for the context's first DDP before their count, for another at its next
shadow pass); a rank that leaves ``join()`` raising tells the joined ranks
(:mod:`.join_leave`). Kept apart from the shadow of each step (:mod:`.join_hook`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from xgrad.failure import FailureChannel, RankError, error_for
from xgrad.torch_backend.ddp_give_up import post_cut_short_pass
from xgrad.torch_backend.ddp_leftovers import given_up_key
from xgrad.torch_backend.ddp_recover import current_graph_task, drop_unreduced, start_forward
from xgrad.torch_backend.group_gone import gone_error
from xgrad.torch_backend.join_announce import carried, count, sum_async
from xgrad.torch_backend.join_leave import carried_over, post_left, wait_for_next, was_carried

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["FailedSteps"]


class FailedSteps:
    """What a join hook does about steps that failed (mixed into :class:`~.join_hook.DDPJoinHook`,
    whose ``__init__`` sets these)."""

    ddp: DistributedDataParallel
    #: a step that failed while this rank shadowed it: raised when the join ends
    failed: BaseException | None
    #: the next step is begun already (ahead of the ranks still training's next pass)
    begun: bool
    #: the namespace of the step the join context began in
    entered: str
    #: the last step this rank began shadowing the others' passes
    shadowed: int
    #: a failed step's next, put off (:meth:`_begin_due`): ``ahead``, else ``None``
    due: bool | None

    def drop_failed_step(self, met: bool = False) -> None:
        """Before this rank counts the ranks still training: drop a step that failed.

        If this rank's last pass left buckets unreduced, that step is dropped now, as the
        ranks still training do at the forward pass where they raise it (they drop it
        first, in step: a fresh group made by all). Else, if the step this rank is in
        failed anywhere (its own forward pass, as it leaves ``join()``; or a ``no_sync``
        pass this rank shadowed, whose failure is posted after its count: also looked
        for as the count waits), it begins the next now, with its fresh group, which the
        ranks still training make at their next forward pass before their count. Raised
        when the join ends, since raising now would leave them waiting for this rank in
        their next steps; at once where a rank still training left ``join()`` raising it
        (:mod:`.join_leave`).

        Not where an accumulation pass of the context's first DDP failed (under xgrad's
        ``Join``) and ``met`` is false: the failing rank sends a count standing in for
        the step's synchronised pass (:func:`~.join_rounds.stand_in`), which this count
        meets, and which waits for it where that rank's next pass is synchronised;
        begun ahead, this rank waited for that rank's mark in the fresh group while that
        rank waited for this count, each to the timeout (one run in three at three
        ranks: the failure was posted before the count or after it). ``met``: the count
        met the stand-in (:func:`~.join_rounds.failed_count`): begun now."""
        ddp = self.ddp
        failed = drop_unreduced(ddp._grad_hooks, self._begin_due)
        if failed is not None:
            self._keep(failed)
            return
        channel = ddp._watch.channel
        # (not the step before's failure, carried over by a rank that left join() with
        # it, join_leave: that rank sent its part of this count, and its note raises it)
        failure = channel.poll()
        if failure is not None and not was_carried(channel):
            if self.shadowed == ddp._watch.step:  # an accumulation pass's, seen after the count
                self._keep(ddp._watch.naming_others(error_for(failure, channel.rank)))
                if (
                    not met
                    and ddp._grad_hooks.accumulating
                    and carried(ddp)
                    and not channel.store.check([given_up_key(channel.prefix)])
                ):
                    return  # the failing rank's stand-in is due in this count: met first
            self._begin_due(ahead=True)

    def post_cut_short(self) -> None:
        """As this rank joins: a backward pass of its own that raised (cut short: posted at
        the next forward pass, and none comes) is posted now, before the count, as that
        forward pass would have. A ``no_sync`` one gives up its step (the count standing
        in for the step's synchronised pass follows as the next step begins,
        :meth:`_begin`); a synchronised one is posted to its step (:mod:`.ddp_unfinished`),
        whose peers wait for this rank's buckets, or for its part of the step's round
        where none of DDP's hooks ran, and the next step is begun before the count
        (:meth:`drop_failed_step`), entering that round with ``FAIL``. Before, a rank
        whose last synchronised backward pass raised and that then joined counted while
        its peers waited for it, and every later step of theirs timed out."""
        if current_graph_task() == -1:
            post_cut_short_pass(self.ddp._watch, self.ddp._grad_hooks)

    def leave_raising(self) -> None:
        """This rank leaves ``join()`` by an exception: in a step that failed (a rank's
        error), the joined ranks, which would wait for its next step, are told
        (:mod:`.join_leave`), its part of the step's round sent if it was still due
        (``FAIL``, else sent at its next forward pass: a joined rank's part, left
        waiting, would meet a later all-reduce on the group, another DDP's). A failure
        this rank raised at the forward pass that began the step it is in (buckets left
        unreduced) is carried over to that step, and its part of the joined ranks' count
        there sent."""
        ddp = self.ddp
        channel = ddp._watch.channel
        carried = carried_over(ddp._watch)
        failure = channel.poll()
        if failure is not None and failure.kind == "error":
            pending, ddp._grad_hooks.join_round = ddp._grad_hooks.join_round, None
            usable = gone_error(ddp.process_group, channel.rank, "") is None
            if pending is not None and usable:
                pending.fail()
            post_left(channel)
            if carried is not None and usable and ddp._join_config.is_first_joinable:
                # the joined ranks' count in this step (join_leave), after the note
                sum_async(ddp.process_group, count(ddp, 0.0))

    def _keep(self, error: BaseException) -> None:
        """A failure to raise when the join ends (the first, when steps failed again)."""
        if self.failed is None:
            self.failed = error

    def _begin(self, ahead: bool = False) -> None:
        """Begin the next step (a fresh group after a failed one); ``ahead``: for the next
        pass of the ranks still training (:attr:`begun`). An accumulation the failed step
        began is over."""
        hooks = self.ddp._grad_hooks
        hooks.accumulating = False
        if hooks.given_up is not None and hooks.stand_in is not None:
            # This rank's own step, given up in a no_sync pass of its last input: it raised
            # there, and skips the synchronised pass the ranks still training run; they
            # raise it there, at the stand-in (start_forward would raise it here again,
            # before the fresh group they make next).
            hooks.given_up = None
            hooks.stand_in(False)
        start_forward(self.ddp._watch, hooks, True, joining=True, gate=self._gate)
        self.begun = ahead

    def _begin_due(self, ahead: bool = False) -> None:
        """:meth:`_begin` where the ranks still training begin this DDP's next step: now
        for the context's first DDP (before their count); for another DDP of xgrad's
        ``Join`` at its next shadow pass or post hook (they begin it at its next forward
        pass, after the first DDP's count: begun before it, each side waited for the
        other to the timeout)."""
        if self._order() is None or self.ddp._join_config.is_first_joinable:
            self._begin(ahead)
        elif self.due is None:
            self.due = ahead

    def _begin_deferred(self) -> None:
        """Begin the step :meth:`_begin_due` put off, if any (quietly, as drop_unreduced)."""
        ahead, self.due = self.due, None
        if ahead is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                self._begin(ahead)

    def _gate(self, failed: FailureChannel) -> None:
        """Before making the fresh group ahead of the ranks still training: wait for
        their marks; one that left ``join()`` raising the step's failure raises it now
        (:mod:`.join_leave`), with nothing begun."""
        try:
            wait_for_next(self.ddp._watch, failed, self.failed, failed.prefix != self.entered)
        except RankError:
            self.failed, self.begun = None, False
            raise

    def _failed_step(self, error: BaseException, ahead: bool = True) -> None:
        """A step this rank shadowed failed on a rank still training: kept to raise when
        the join ends, the next step begun with its fresh group, as the ranks still
        training do at their next forward pass; not ``ahead`` where their pass left
        buckets unreduced (they raise at that pass, before its count, and begin the step
        after at the next)."""
        self._keep(error)
        self._begin_due(ahead)
        order = self._order()
        if order is not None and self.ddp._join_config.is_first_joinable:
            order.failed = True  # the rest of the iteration is skipped (main_hook)

    def _order(self) -> Any:
        """The DDP's forward passes in xgrad's ``Join`` (:mod:`.join_order`); ``None``
        under PyTorch's (a DDP keeps the last xgrad context's)."""
        ddp = self.ddp
        return ddp._join_order if ddp._counted_config is ddp._join_config else None
