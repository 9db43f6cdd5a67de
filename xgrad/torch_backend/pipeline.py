"""Pipeline runtime on torch.distributed: one process per rank runs its schedule's actions.

The runtime and its constructor live here; the event loop is
:mod:`~xgrad.torch_backend.pipeline_loop`, the wire format (pytrees of tensors)
:mod:`~xgrad.torch_backend.pipeline_wire`, checkpointing
:mod:`~xgrad.torch_backend.pipeline_recompute`, and the step's private group (made, set
aside after a failure, made anew) :mod:`~xgrad.torch_backend.pipeline_group`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from xgrad.failure import Failure, FailureChannel
from xgrad.pipeline import Invocation, Schedule
from xgrad.torch_backend.failure import Waiters
from xgrad.torch_backend.group_keys import StoreKeys
from xgrad.torch_backend.pipeline_args import (
    check_modules,
    check_settings,
    runtime_schedule,
    slot_map,
)
from xgrad.torch_backend.pipeline_call import StepCall
from xgrad.torch_backend.pipeline_ddps import (
    data_parallel,
    stage_ddps,
    stage_no_sync,
    unpipelined,
)
from xgrad.torch_backend.pipeline_eval import Evaluation
from xgrad.torch_backend.pipeline_lanes import default_lanes
from xgrad.torch_backend.pipeline_loop import StepLoop
from xgrad.torch_backend.pipeline_recompute import CHECKPOINT_MODES
from xgrad.torch_backend.pipeline_slot import ActionRecord
from xgrad.torch_backend.pipeline_specs import chunk_specs
from xgrad.torch_backend.pipeline_wire import EdgeCache
from xgrad.torch_backend.private_groups import require_member

if TYPE_CHECKING:  # torch's module takes a second and a half to import (pipeline_specs)
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

__all__ = ["CHECKPOINT_MODES", "ActionRecord", "PipelineRuntime"]


class PipelineRuntime(StepLoop, Evaluation, StepCall):
    """Runs this rank's part of a pipeline schedule, as an event loop over its actions.

    The first stage reads microbatches of the input, the last computes the loss on
    microbatches of the target, the middle ones receive and send; activations move as
    point-to-point messages whose receives are posted ahead, on private gloo groups
    through host memory also for GPU stages (see
    :mod:`~xgrad.torch_backend.pipeline_lanes`) and are dropped once sent. Gradients
    accumulate into the partitions' ``.grad`` and equal those of the whole model run on
    the whole batch (divided by m after the backward, as torch's: ``pipeline_scale``; so
    the loss must be a mean over the batch, as ``MSELoss``'s default; ``scale_grads=False``
    for a sum). A batch m does not divide splits as torch's (10 rows: 3, 3, 2, 2), still
    over m: then not the whole batch's mean (:mod:`~xgrad.torch_backend.pipeline_rows`).

    Stage inputs and outputs are pytrees (tuples, lists, dicts of tensors, integer masks,
    tensors that need no gradient, constants), whose shapes may change from step to step;
    gradients flow back to every floating leaf that requires one. A checkpointed forward is
    redone with the random state it first ran with.

    Failures: an exception in any action on any rank makes every rank raise
    :class:`xgrad.failure.RankError` naming where it started (``"rank 1: 1F3 failed:
    ValueError: ..."``; then ``"also rank 2: ..."`` for each other failure that reached it
    by then) at once, even when the failing process stays alive (it poisons the
    messages its peers wait for, see :mod:`~xgrad.torch_backend.pipeline_comm`); a rank
    that dies is named after its heartbeat stops (about a second), one that freezes after
    ``timeout``, and no wait lasts longer than that. The next :meth:`step` starts clean, on
    a fresh private group; gradients the failed step had accumulated stay
    in ``.grad``, so zero them before retrying. Before the first step, every rank checks
    that all run the same schedule (one all-gather of its digest).

    Attributes:
        records: the last step's actions with their wall-clock start and end (and the time
            each spent blocked on a message).
        peak_held_bytes: the most bytes of activations and gradients held at once so far.
        release_sends: ``"posted"`` (default; a sent buffer is freed once a message from
            its peer proves the receive posted, see ``pipeline_posted``) or ``"gradient"``.

    Args:
        schedule: a schedule (compute-only ones get :func:`~xgrad.pipeline.insert_comms`);
            validated, so every send has its receive and no order deadlocks.
        partitions: this rank's modules, slot ``index`` of its :class:`Location` s. Without
            ``invocations``, slot k is the k-th virtual stage placed on this rank.
        loss_fn: ``loss_fn(output, target)`` on the last stage (pytrees as the stage returns
            and the targets hold), with :meth:`step`'s ``loss_kwargs`` as keywords; its
            parameters, a module's or a closure's, are treated as the last stage's, and
            the tensors a stage's forward reads without holding them as that stage's
            (``pipeline_loss_params``).
        invocations: fairscale-style invocations mapping virtual stages to partitions (a
            partition may be invoked more than once; its gradient is then the sum).
        group: the pipeline process group (default: the default group); schedule rank r is
            group rank r.
        checkpoint: ``"always"``, ``"except_last"`` (default) or ``"never"``.
        timeout: seconds (or a ``timedelta``) any receive or send may take before an error names it (a frozen
            peer is named after it).
        no_sync: for data parallelism, a context factory ``no_sync(partition_index)`` under
            which forwards that must not reduce gradients run (DDP's ``no_sync``); only the
            last microbatch's forward with gradients runs outside it. Default, for a
            partition holding a ``DistributedDataParallel`` (torch's or xgrad's): that
            DDP's own, as torch's ``PipelineStage`` uses it (``pipeline_ddps.stage_no_sync``).
        reduce_grad: called as ``reduce_grad(partition_index)`` at a partition's last
            REDUCE_GRAD action (torch's lowering and :func:`~xgrad.pipeline.add_stage_ops`
            place one after a stage's last backward) to reduce its gradients (divided by
            m after, as torch's) across data-parallel replicas. ``dp_group`` gives the
            default: the gradients averaged over that group in one flat all-reduce
            (bounded, on the failure channel), which works with split (I/W) backward too
            (see ``runtime_schedule`` for a schedule without REDUCE_GRAD). Without either REDUCE_GRAD, like UNSHARD and RESHARD
            (FSDP's), does nothing.
        dp_group: the data-parallel group of this rank's partitions (see ``reduce_grad``).
            What a stage or its loss reads of its own that no partition holds (a closure's
            temperature) is averaged with them; what the step was given on this rank, or
            was computed from, is the replica's data, its gradient left to it (a loss on
            another rank than stage 0's that closes over the batch: give the batch to
            ``step`` there too; see ``pipeline_step_data``).
        device: where received tensors go (default: the device of the stage's parameters).
        scale_grads: the gradients divided by m (default), as torch's schedules divide
            them: for a loss that is a mean over its batch. False: for a sum (the
            gradients, and the loss :meth:`step` returns, are then sums over microbatches).
        args_chunk_spec: torch's: how stage 0's positional arguments split into
            microbatches, ``(spec,)`` for xgrad's one (``inputs``), ``spec`` a
            ``TensorChunkSpec(split_dim)`` (``TensorChunkSpec(1)``: sequence-first),
            ``_Replicate()`` (given whole to each) or a pytree of them, a leaf standing for
            its subtree (:mod:`~xgrad.torch_backend.pipeline_specs`). Default: dim 0. The
            targets split along dim 0, as torch's.
        kwargs_chunk_spec: torch's: a spec per keyword of the model, by name; a step that
            gives keywords must give those it names. Default: a tensor along dim 0 (each
            tensor of a container too), any other value whole.
        output_merge_spec: torch's: how :meth:`step` and :meth:`eval` merge the last
            stage's outputs (``TensorChunkSpec(dim)``, ``sum_reducer``). Default: dim 0.

    Example:
        >>> rt = PipelineRuntime(one_f_one_b(2, 4), [stage], nn.MSELoss())  # doctest: +SKIP
        >>> loss = rt.step(x if rank == 0 else None, y if rank == 1 else None)
        >>> loss = rt.step(x if rank == 0 else None, target=y if rank == 1 else None)  # torch's
        >>> out = rt.step(x, target=y, return_outputs=True)  # torch's return: merged outputs
        >>> loss = rt.step(x, target=y, mask=m)  # the model's keywords, split as torch's
    """

    def __init__(
        self,
        schedule: Schedule,
        partitions: Sequence[nn.Module],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        invocations: Sequence[Invocation] | None = None,
        group: Any = None,
        checkpoint: str = "except_last",
        timeout: float | timedelta = 60.0,
        no_sync: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
        reduce_grad: Callable[[int], None] | None = None,
        dp_group: Any = None,
        device: torch.device | str | None = None,
        scale_grads: bool = True,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any, ...] | TensorChunkSpec | None = None,
    ) -> None:
        self.timeout = check_settings(checkpoint, timeout)
        require_member(group, "run the pipeline")
        self.group = group
        self.rank = dist.get_rank(group)
        reduces = dp_group is not None or reduce_grad is not None
        world = dist.get_world_size(group)
        self.schedule = runtime_schedule(schedule, self.rank, world, reduces=reduces)
        self.partitions = list(partitions)
        self._slot_of = slot_map(schedule, self.partitions, invocations, self.rank)
        check_modules(self.partitions, self.rank)
        self.loss_fn = loss_fn
        self.checkpoint = checkpoint
        if not isinstance(scale_grads, bool):
            raise TypeError(f"scale_grads={scale_grads!r} must be a bool")
        self.scale_grads = scale_grads
        self._chunk_specs = chunk_specs(
            args_chunk_spec, kwargs_chunk_spec, output_merge_spec, self.rank
        )
        no_sync = stage_no_sync(self.partitions, self.rank, no_sync, dp_group)
        self._no_sync = no_sync
        self._reduce_grad = reduce_grad
        self._dp_group = dp_group
        self._reduce_at, self._dp, self._synced = data_parallel(
            self.schedule, self.rank, self._slot_of, self.timeout, no_sync, reduce_grad, dp_group
        )
        self.device = None if device is None else torch.device(device)
        self._edges = EdgeCache()
        self._agreed: str | None = None
        self._p2p: tuple[Any, ...] | None = None
        self._lanes = default_lanes(dist.get_world_size(group))
        self._channel: FailureChannel | None = None
        self._written: list[StoreKeys] = []  # deleted at the end of a good step
        self._lost: Failure | None = None  # the rank the last step lost, if it lost one
        self._tag = 0
        self._p2p_ranks: list[int] = []
        # The failed step this runtime set aside (its groups and wire: pipeline_aside).
        self._dying: int | None = None
        self._index = 0  # the number of the step opened last on the pipeline group
        self._start_modes()  # the schedule, its wire plan and digest (eval swaps them)
        #: receives are posted this many actions ahead of the action that runs them (A/B at
        #: p = 2: 1, 4, 8, 32 ahead gave 1F1B 56.9, 53.9, 51.5, 51.7 ms per step).
        self.post_ahead = 8
        # Receives are awaited on this thread (see pipeline_comm); waits that must watch
        # the failure channel (a collective, the step's last sends) hand off to these,
        # whose threads end when this runtime is collected.
        self._waiters = Waiters(self, "xgrad-pipeline-wait", "xgrad-pipeline-send")
        self.release_sends = "posted"
        self.records: list[ActionRecord] = []
        self.peak_held_bytes = 0
        self._devices, self._losses = {}, {}
        self._ddps = stage_ddps(self.partitions)  # told when a step fails (pipeline_ddps)
        for ddp in self._ddps:  # (their no_sync passes cut short are given up here)
            ddp._grad_hooks.pipelined += 1
        weakref.finalize(self, unpipelined, [weakref.ref(d._grad_hooks) for d in self._ddps])
        self._ddp_steps: list[int] = []
