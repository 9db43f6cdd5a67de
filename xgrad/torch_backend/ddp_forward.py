"""DDP's steps around the wrapped module's forward pass, outside dynamo's view.

Before the module runs: drop a failed backward pass, tell ``join()`` this rank still
trains, sync buffers (:mod:`.ddp_buffers`), tell joined ranks what this pass is
(:mod:`.join_rounds`), rebuild the buckets once (and re-alias gradient views), check once
per plan that the ranks agree, move and cast the inputs. After it
(:mod:`.ddp_post_forward`): find the unused parameters and prepare the reducer for the
backward pass. The wrapper calls these through ``torch._dynamo.disable``-d methods
(:class:`ForwardDDP`, mixed into it), so no collective here is traced.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from xgrad.agreement import check_agreement
from xgrad.failure import RankError
from xgrad.raising import raise_from
from xgrad.torch_backend.ddp_buffers import first_pass_regrouped, sync_buffers
from xgrad.torch_backend.ddp_checks import fingerprint
from xgrad.torch_backend.ddp_compile import frame_skipped, outside_dynamo, traced_module_call
from xgrad.torch_backend.ddp_inbackward import setup_in_backward_optimizers
from xgrad.torch_backend.ddp_post_forward import post_forward
from xgrad.torch_backend.ddp_recover import (
    abandon_step,
    drop_unreduced,
    raise_as_the_deferring,
    reduces_unsynced,
    start_forward,
)
from xgrad.torch_backend.group_gone import gone_error
from xgrad.torch_backend.join_announce import Row
from xgrad.torch_backend.join_leave import training_gate
from xgrad.torch_backend.join_notify import notify_join_context
from xgrad.torch_backend.join_order import before_forward
from xgrad.torch_backend.join_rounds import Announcing, announce, read_announcement
from xgrad.torch_backend.join_settle import settle_next

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel
    from xgrad.torch_backend.ddp_failure import StepWatch
    from xgrad.torch_backend.ddp_hooks import GradientHooks
    from xgrad.torch_backend.ddp_logging import RuntimeLog


def pre_forward(
    ddp: DistributedDataParallel, inputs: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Any]:
    """Everything DDP does before the module runs; returns the inputs to run it on."""
    ddp._forward_started = time.perf_counter()
    if not getattr(ddp, "_lazy_init_ran", False):  # PyTorch's _lazy_init
        setup_in_backward_optimizers(ddp)
    sync = torch.is_grad_enabled() and ddp.require_backward_grad_sync
    if torch.is_grad_enabled() or ddp._check_sync_bufs_pre_fwd():  # a pass that communicates
        # on a group this rank aborted (abort_group) or destroyed: said so, not c10d's
        # KeyError for its store (an evaluation that syncs no buffer runs, as PyTorch's)
        gone = gone_error(ddp.process_group, ddp._watch.channel.rank, "DistributedDataParallel")
        if gone is not None:
            raise gone
    before_forward(ddp)  # under xgrad's Join: its order, another DDP's backward first
    if ddp._announcing is not None or ddp._watch.deferred is not None:
        settle_next(ddp)  # the last pass raised before reading them (join_settle)
    if torch.is_grad_enabled():
        # The last backward pass left buckets unreduced: PyTorch's error, raised where
        # PyTorch raises it. Every rank raises here (the peers were told at that pass's
        # end), after dropping the failed step as a forward pass does, so that a rank
        # whose inputs then run out (join) leaves no one waiting in that.
        unfinished = drop_unreduced(ddp._grad_hooks, lambda: _start(ddp, sync))
        if unfinished is not None:
            ddp._watch.raised_at = ddp._watch.step  # in the step begun now (join_leave)
            raise unfinished
    step = ddp._watch.step
    _start(ddp, sync)
    if torch.is_grad_enabled():  # where the ranks that deferred a failure raise it
        raise_as_the_deferring(ddp._watch, step, ddp._join_config.enable)
    first_pass_regrouped(ddp)  # the last step failed: agreement and buffers again
    flags = _flags(ddp, sync) if ddp._join_config.enable else None
    ddp._still_training = notify_join_context(ddp, flags)
    if sync:  # PyTorch's logger samples here, before the rebuild
        ddp._runtime_log.sample(ddp, ddp._runtime_logging_sample_rate)
    if ddp._check_sync_bufs_pre_fwd():  # PyTorch's: no buffer hook, or one run before
        sync_buffers(ddp)
    if flags is not None:
        if ddp._announcing is None:  # else it rode in the count (join_announce.carried)
            announce(ddp, *flags)
        if (torch.is_grad_enabled() and ddp.reducer.rebuild_due()) or (
            sync and ddp._agreement_pending
        ):
            read_announcement(ddp)  # before this rank's next collective on the group
    if torch.is_grad_enabled() and ddp.reducer.rebuild_buckets():  # after: join_rounds
        ddp._agreement_pending = True
        if ddp.gradient_as_bucket_view:
            ddp._grad_hooks.alias_grads_to_buckets()
    if sync:
        check_agreement_once(ddp)
    if ddp.device_ids:
        device = torch.device(ddp.device_type, ddp.device_ids[0])
        inputs, kwargs = tree_map(
            lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, (inputs, kwargs)
        )
    if ddp._casts is not None:
        wrong = ddp._casts.wrong_dtype(ddp._watch.channel.rank)
        if wrong is not None:  # posted as a forward pass's failure (none without grad)
            raise_from(ddp._forward_failed(wrong) if torch.is_grad_enabled() else wrong, wrong)
        return ddp._casts.to_low(inputs, kwargs)
    return inputs, kwargs


def _flags(ddp: DistributedDataParallel, sync: bool) -> Row:
    """What to tell joined ranks this forward pass is (:mod:`.join_announce`): whether it
    computes gradients, and whether a reducing backward pass may follow (a synchronised
    one, or a ``no_sync`` one that reduces, as after a forward pass left without backward).
    PyTorch says "reduce" for every forward pass, so a ``torch.no_grad()`` one under join
    makes its joined ranks wait for buckets that never come. Sent before the module runs
    (in the join context's count, or on its own), read after it (:func:`post_forward`),
    so that no one waits for it."""
    grad = torch.is_grad_enabled()
    hooks = ddp._grad_hooks
    reduce = sync or (grad and not hooks.accumulating and reduces_unsynced(hooks))
    return grad, reduce, sync


def _start(ddp: DistributedDataParallel, sync: bool) -> None:
    start_forward(
        ddp._watch,
        ddp._grad_hooks,
        sync,
        ddp._join_config.enable,
        accumulate=not ddp.require_backward_grad_sync,
        gate=training_gate(ddp),  # after a failed step: a rank that left join() raising
    )


def check_agreement_once(ddp: DistributedDataParallel) -> None:
    """Compare plan, parameters and hook across ranks, once per plan (a collective)."""
    if ddp._agreement_pending:
        mine = fingerprint(ddp.plan, ddp.parameter_names, ddp._params, ddp._hook_name)
        check_agreement(ddp.comm, mine, where="DistributedDataParallel")
        ddp._agreement_pending = False


class ForwardDDP:
    """Mixed into the DDP: ``forward``, the module traced, the steps around it not (ddp_compile)."""

    _watch: StepWatch
    _grad_hooks: GradientHooks
    _runtime_log: RuntimeLog
    #: under join(): this forward pass's announcement, sent, not read yet (join_rounds)
    _announcing: Announcing | None = None
    #: the join config set by xgrad's own Join, whose count a leaving rank reads (join_rounds)
    _counted_config: Any = None
    #: a joined rank: the announcement its last count carried, for its hook (join_announce)
    _heard: Announcing | None = None
    #: the joinables of xgrad's Join this DDP is in, in order; their passes (join_order)
    _join_peers: tuple[Any, ...] = ()
    _join_order: Any = None

    @frame_skipped
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs = self._pre_forward(*inputs, **kwargs)
        try:
            output = traced_module_call(self, *inputs, **kwargs)
        except Exception as exc:  # every rank raises it, named (ddp_failure)
            read_announcement(self)  # type: ignore[arg-type]  # as if before the module ran
            if not torch.is_grad_enabled():
                # No backward follows (an evaluation): no peer waits for this pass, and a
                # failure posted to the step reached the peers at their next training
                # step, which had not failed. Its own exception, on this rank only.
                raise
            raise_from(self._forward_failed(exc), exc)
        except BaseException as exc:  # Ctrl-C, exit: the peers are told, here it stays as is
            self._watch.post("forward", exc)
            raise
        return self._post_forward(output)

    def _forward_failed(self, exc: Exception) -> RankError:
        """The error of a forward pass that raised, posted where the peers look: a
        ``no_sync`` pass's in the step it accumulated for (``abandon_step``)."""
        error = None
        if self._grad_hooks.accumulating:
            error = abandon_step(self._watch, self._grad_hooks, "forward", exc, until_sync=True)
        if error is None:
            error = self._watch.post("forward", exc)
        self._runtime_log.error(error)  # PyTorch's logger keeps the DDP's last error
        return error

    def _abandon_step(self, where: str, exc: BaseException, since: int | None = None) -> None:
        """This rank gave up the step the DDP is in or accumulating for: the peers are
        told at once (a pipeline whose step failed calls this; see ``abandon_step``).
        ``since``: the DDP's step number when the caller's step began; still the same,
        the DDP had not begun the step its peers are in."""
        unbegun = since is not None and self._watch.step == since
        abandon_step(self._watch, self._grad_hooks, where, exc, unbegun=unbegun)

    @outside_dynamo
    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Rebuild, buffer sync, input placement and casts (never traced by dynamo)."""
        try:
            return pre_forward(self, inputs, kwargs)  # type: ignore[arg-type]
        except Exception as exc:
            self._runtime_log.error(exc)
            read_announcement(self)  # type: ignore[arg-type]  # sent before it raised
            raise

    @outside_dynamo
    def _post_forward(self, output: Any) -> Any:
        """Unused-parameter search and the reducer's preparation (never traced by dynamo)."""
        try:
            return post_forward(self, output)  # type: ignore[arg-type]
        except Exception as exc:
            self._runtime_log.error(exc)
            raise

    def _check_agreement(self) -> None:
        check_agreement_once(self)  # type: ignore[arg-type]
