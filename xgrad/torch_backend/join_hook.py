"""What a rank that ran out of inputs does under ``join()``: the shadow of the others' steps.

:class:`DDPJoinHook` is the ``JoinHook`` a join context runs for a DDP once its rank has
joined: per iteration of the ranks still training, it enters the same collectives with
zeros as its gradients (the right-hand column of :mod:`.join`'s table), and when every
rank has joined, every rank takes the parameters of one that joined last
(:func:`~.join_final.sync_final_model`). Kept apart from the context, the DDP's ``Joinable`` members
and the side of the ranks still training (:mod:`.join`), which make the hook and count
the ranks; this is the one place that shadows a step.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.algorithms.join import JoinHook

from xgrad.failure import FailureChannel, RankError, error_for
from xgrad.torch_backend.ddp_pass_end import UNREDUCED
from xgrad.torch_backend.ddp_recover import drop_unreduced, start_forward
from xgrad.torch_backend.group_gone import gone_error
from xgrad.torch_backend.join_announce import count, sum_async
from xgrad.torch_backend.join_final import sync_final_model
from xgrad.torch_backend.join_leave import carried_over, post_left, wait_for_next, was_carried
from xgrad.torch_backend.join_rounds import hear, posted, wait_round
from xgrad.torch_backend.join_settle import close_round, left

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["DDPJoinHook"]


class DDPJoinHook(JoinHook):
    """What a rank that has run out of inputs does for each iteration of the others.

    Args:
        ddp: xgrad's :class:`~xgrad.torch_backend.DistributedDataParallel`.
        divide_by_initial_world_size: divide gradients by the world size (``True``) or
            by the number of ranks still training.
    """

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        if not isinstance(divide_by_initial_world_size, bool):
            raise TypeError(
                f"divide_by_initial_world_size must be a bool, got {divide_by_initial_world_size!r}"
            )
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        # PyTorch's logger records it here: ``join_uneven_inputs`` in the logging data.
        ddp._join_uneven_inputs = True
        #: a step that failed while this rank shadowed it (or its own last pass, which
        #: left buckets unreduced): raised when the join ends.
        self.failed: BaseException | None = None
        #: the next step is begun already (after a failed one, with its fresh group): the
        #: next pass of the ranks still training, whatever its kind, began it there.
        self.begun = False
        #: the namespace of the step the join context began in: a failure there, and its
        #: notes (join_leave), are an earlier context's
        self.entered = ddp._watch.channel.prefix
        #: the last step this rank began shadowing the others' passes
        self.shadowed = -1
        #: a failed step's next, put off (:meth:`_begin_due`): ``ahead``, else ``None``
        self.due: bool | None = None
        super().__init__()

    def drop_failed_step(self) -> None:
        """Before this rank counts the ranks still training: drop a step that failed.

        If this rank's last pass left buckets unreduced, that step is dropped now, as the
        ranks still training do at the forward pass where they raise it (they drop it
        first, in step: a fresh group made by all). Else, if the step this rank is in
        failed anywhere (its own forward pass, as it leaves ``join()``; or a ``no_sync``
        pass this rank shadowed, whose failure is posted after its count: also looked
        for as the count waits), it begins the next now, with its fresh group, which the
        ranks still training make at their next forward pass before their count. Raised here when the join ends, since raising
        now would leave them waiting for this rank in their next steps; at once where a
        rank still training left ``join()`` raising it (:mod:`.join_leave`)."""
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
            self._begin_due(ahead=True)

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

    def main_hook(self) -> None:
        """Enter the collectives of one forward pass of the others and of the backward
        pass that follows it, or of the next forward pass when none did (join_rounds).

        With several DDPs in xgrad's ``Join``, a step of the first that failed ends the
        iteration: the ranks still training skip the other DDPs' passes (they catch the
        failure around the iteration), and so do the joined ranks' hooks."""
        ddp = self.ddp
        order = self._order()
        if order is not None:
            if not ddp._join_config.is_first_joinable and order.failed:
                return
            order.failed = False
        self._begin_deferred()
        left(ddp)  # its own pass settled; left in a round: its count was its part
        while True:
            ddp._check_and_sync_module_buffers()  # from a rank still training (ddp_buffers)
            heard = hear(ddp)
            begun, self.begun = self.begun, False
            if heard.grad and not heard.reduce and not heard.param_sync:
                # A no_sync pass: the ranks still training begin the step it accumulates
                # for at the accumulation's first pass (ddp_recover), and post there what
                # fails in it: begun here too (or already, ahead), not at the step's
                # synchronised pass.
                if begun:
                    ddp._grad_hooks.accumulating = True
                else:
                    start_forward(ddp._watch, ddp._grad_hooks, False, True, accumulate=True)
                    self.shadowed = ddp._watch.step
            elif heard.reduce and not begun:
                # The ranks still training began a step at this forward pass: begin it here
                # too, so what fails in the shadow pass (a comm hook) is posted where they
                # look; before the rebuild, as they do (a failed step undoes what it taught
                # the reducer since its start: the rebuild too, on every rank alike).
                start_forward(ddp._watch, ddp._grad_hooks, True, joining=True)
            if heard.grad and ddp.reducer.rebuild_buckets():  # as in forward: compared again
                ddp._agreement_pending = True
                if ddp.gradient_as_bucket_view:
                    ddp._grad_hooks.alias_grads_to_buckets()
            ddp.require_forward_param_sync = heard.param_sync
            if not heard.reduce:
                return
            if ddp._watch.regrouped:  # a fresh group: compared again, as the others do
                ddp._watch.regrouped = False
                ddp._agreement_pending = True
            if heard.param_sync:
                ddp._check_agreement()
            if ddp._join_config.is_first_joinable:
                then = wait_round(ddp, heard.training)
                if then == "forward":
                    continue
                if then == "failed":
                    self._failed_step(posted(ddp))
                if then != "backward":
                    return
            break
        try:
            ddp.reducer.shadow_backward(sparse_zero=_empty_sparse_gradient)
        except RankError as error:
            if error.failure.kind != "error" or error.failure.rank == ddp._watch.channel.rank:
                raise  # this rank's own (every rank raises it at once), or a rank lost
            self._failed_step(error, ahead=error.failure.where != UNREDUCED)
            return
        if ddp.reducer.needs_rebuild_order():
            # Never trained (or not through a whole iteration): offer the definition
            # order, so this rank can take part in the rebuild the others do next.
            ddp.reducer.offer_rebuild_order(range(len(ddp.reducer.params)))

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters (and buffers) of a rank that joined last; then
        a failure kept is raised: by xgrad's ``Join`` once every DDP's post hook ran (the
        peers wait for the others' in theirs), here under PyTorch's."""
        ddp = self.ddp
        self._begin_deferred()
        close_round(ddp)
        sync_final_model(ddp, is_last_joiner)
        self.begun = False
        failed, self.failed = self.failed, None
        order = self._order()
        if failed is not None:
            if order is None:
                raise failed
            order.kept = order.kept or failed


def _empty_sparse_gradient(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient with no entries, laid out as an embedding's (one sparse dimension).

    Only ``nn.Embedding`` and ``nn.EmbeddingBag`` make sparse gradients; gloo sums sparse
    tensors by gathering every rank's entries, so this one adds nothing.
    """
    indices = torch.empty((1, 0), dtype=torch.int64, device=param.device)
    values = torch.empty((0, *param.shape[1:]), dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape)
