"""What a rank that ran out of inputs does under ``join()``: the shadow of the others' steps.

:class:`DDPJoinHook` is the ``JoinHook`` a join context runs for a DDP once its rank has
joined: per iteration of the ranks still training, it enters the same collectives with
zeros as its gradients (the right-hand column of :mod:`.join`'s table), and when every
rank has joined, every rank takes the parameters of one that joined last
(:func:`~.join_final.sync_final_model`). Kept apart from the context, the DDP's ``Joinable`` members
and the side of the ranks still training (:mod:`.join`), which make the hook and count
the ranks; this is the one place that shadows a step. What the hook does about a step
that failed is :mod:`.join_failed`'s (a mixin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.algorithms.join import JoinHook

from xgrad.failure import RankError
from xgrad.torch_backend.ddp_buffers import first_pass_regrouped
from xgrad.torch_backend.ddp_pass_end import UNREDUCED
from xgrad.torch_backend.ddp_recover import start_forward
from xgrad.torch_backend.join_failed import FailedSteps
from xgrad.torch_backend.join_final import sync_final_model
from xgrad.torch_backend.join_rounds import hear, posted, wait_round
from xgrad.torch_backend.join_settle import close_round, left

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["DDPJoinHook"]


class DDPJoinHook(FailedSteps, JoinHook):
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
            if ddp._join_config.is_first_joinable:
                order.stepped = False  # until a backward pass is shadowed (join_others)
        self._begin_deferred()
        left(ddp)  # its own pass settled; left in a round: its count was its part
        while True:
            # Begun ahead, after a failed step (join_failed): the ranks still training
            # sync the buffers at this pass, whatever the last pass heard said; else their
            # broadcast met this rank's next collective.
            first_pass_regrouped(ddp)
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
            # Begun at this shadow pass (another DDP of xgrad's Join), below the buffers'
            # turn: the flag would sync them at the next pass, which theirs need not.
            first_pass_regrouped(ddp, buffers=False)
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
        if order is not None and ddp._join_config.is_first_joinable:
            order.stepped = True  # the iteration's step: the other joinables' hooks run
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
    # (invariants said, not checked: an empty tensor has none to break, and a tensor made
    # without saying makes torch print a one-time warning about the user's code)
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=False)
