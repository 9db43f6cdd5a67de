"""The runtime's settings and a step's state as every part of the pipeline runtime reads
them, and the lookups on them that involve no loss and no gradient: which module and
device a stage has, bounded waits, the checkpoint and no_sync decisions, a microbatch's
keywords and whether its forward read something of the step's own that requires grad.

Kept apart from :mod:`~xgrad.torch_backend.pipeline_stage_base`, which builds on these the
forward call with its loss and what a step does to the gradients (their division by m,
REDUCE_GRAD over a data-parallel group): everything here only reads the attributes that
:class:`~xgrad.torch_backend.pipeline.PipelineRuntime` and its step set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import nn

from xgrad.failure import FailureChannel
from xgrad.pipeline import Action, Schedule
from xgrad.torch_backend.failure import Waiters, wait_work
from xgrad.torch_backend.pipeline_comm import StepWire
from xgrad.torch_backend.pipeline_joins import StageJoins
from xgrad.torch_backend.pipeline_loss_params import StageLeaves
from xgrad.torch_backend.pipeline_recompute import checkpointed
from xgrad.torch_backend.pipeline_scale import StepScaling
from xgrad.torch_backend.pipeline_slot import Slot
from xgrad.torch_backend.pipeline_specs import ChunkSpecs
from xgrad.torch_backend.pipeline_step_data import StepData
from xgrad.torch_backend.pipeline_wire import tensor_leaves

__all__ = ["StageSettings"]


class StageSettings:
    """The settings and per-step state the runtime sets, and the lookups on them."""

    schedule: Schedule
    partitions: list[nn.Module]
    loss_fn: Callable[..., torch.Tensor]  # loss_fn(output, target, **step's loss_kwargs)
    group: Any
    rank: int
    checkpoint: str
    scale_grads: bool  # the gradients divided by m after the backward (torch's default)
    timeout: float
    device: torch.device | None
    _slot_of: dict[int, int]
    _no_sync: Callable[[int], contextlib.AbstractContextManager[Any]] | None
    _channel: FailureChannel | None
    _waiters: Waiters
    _dp_group: Any
    _dp: Any  # the data-parallel steps (pipeline_ddps.DataParallelSteps), with _dp_group
    _reduce_grad: Callable[[int], None] | None
    _reduce_at: dict[int, int]  # partition slot -> the stage of its last REDUCE_GRAD
    _synced: dict[int, int]  # with no_sync: stage -> its synchronised microbatch
    _actions: tuple[Action, ...]  # this rank's, in order (the mode in use: pipeline_eval)
    _scaling: StepScaling | None = None  # this step's division by m (pipeline_scale)
    _points: tuple[tuple[Action, ...], dict[int, int]] | None = None  # scale_points, kept
    _wire: StepWire  # the step's sends and receives
    _devices: dict[int, torch.device]  # per stage, where its parameters are (this step)
    _losses: dict[int, torch.Tensor]  # per microbatch, its loss (unscaled; this step)
    _joins: StageJoins  # per stage graph, where W starts (this step)
    _leaves: dict[int, StageLeaves]  # per stage, what it (its loss) reads of its own
    _whole_walk: bool = False  # each forward walks its stage's graph for them (this step)
    _data: StepData | None = None  # the step's data on this rank (this step)
    _reads_data: AbstractSet[int] = frozenset()  # stages whose walks read data (this step)
    _evaluating: bool = False  # this step runs the forwards alone (eval)
    _outputs: dict[int, Any]  # per microbatch, the last stage's output (detached)
    _keep_outputs: bool = False  # kept: eval(), or step(), with return_outputs=True
    _loss_kwargs: dict[str, Any] | None = None  # step(loss_kwargs=), torch's
    _keywords: dict[str, Any] | None = None  # step(**kwargs): the model's, whole batch
    _keyword_mbs: list[dict[str, Any]] | None = None  # the same per microbatch (this step)
    _target_mbs: list[Any] | None = None  # the targets per microbatch (the last stage's rank)
    _chunk_specs: ChunkSpecs = ChunkSpecs()  # the runtime's torch chunk specs (pipeline_specs)

    def _module(self, stage: int) -> nn.Module:
        return self.partitions[self._slot_of[stage]]

    def _device(self, stage: int) -> torch.device:
        if self.device is not None:
            return self.device
        found = self._devices.get(stage)
        if found is None:  # once per stage and step (the modules may move between steps)
            param = next(self._module(stage).parameters(), None)
            found = param.device if param is not None else torch.device("cpu")
            self._devices[stage] = found
        return found

    def _wait(self, work: Any, what: str) -> None:
        wait_work(work, self._channel, timeout=self.timeout, what=what, waiter=self._waiters[0])

    def _data_parallel(self, stage: int) -> bool:
        """Whether ``stage`` is a DDP replica (``no_sync`` given, or a DDP as its module)."""
        return self._no_sync is not None or hasattr(self._module(stage), "no_sync")

    def _checkpointed(self, stage: int, microbatch: int) -> bool:
        if self._evaluating:
            return False  # no backward: nothing to recompute
        synced = self._synced.get(stage) == microbatch
        return checkpointed(self.checkpoint, microbatch, self.schedule.num_microbatches, synced)

    @contextlib.contextmanager
    def _sync_context(self, stage: int, microbatch: int) -> Iterator[None]:
        synced = self._synced.get(stage) == microbatch
        if self._no_sync is None or (synced and torch.is_grad_enabled()):
            yield
        else:
            with self._no_sync(self._slot_of[stage]):
                yield

    def _keywords_of(self, mb: int) -> dict[str, Any]:
        """Microbatch ``mb``'s keywords for this rank's stages (torch gives a rank's
        ``step(**kwargs)`` to each stage it runs)."""
        return {} if self._keyword_mbs is None else self._keyword_mbs[mb]

    def _shares(self, stage: int) -> bool:
        """Whether ``stage``'s graph (its loss's) reaches nodes made before its forward,
        that each microbatch's backward goes through: those keep the graph
        (pipeline_shared_graph)."""
        found = self._leaves.get(stage)
        return found is not None and found.older

    def _takes_batch_grad(self, stage: int, slot: Slot, mb: int) -> bool:
        """Whether ``stage``'s forward read something of the step's own that requires grad:
        the batch (stage 0), a keyword, or (the last stage's loss) the target or a
        ``loss_kwargs`` tensor; or the step's data read otherwise (the batch a closure
        reads whole: pipeline_step_data). Its backward then goes on into them (into
        ``.grad`` of the tensors the caller gave), as the unpipelined model's does: under
        zero bubble W takes the whole backward (its joins reach parameters only)."""
        if stage in self._reads_data:  # the batch read whole, say (pipeline_step_data)
            return True
        if any(t.requires_grad for t in tensor_leaves(self._keywords_of(mb))):
            return True
        if stage == self.schedule.num_stages - 1 and self._target_mbs is not None:
            theirs = (self._target_mbs[mb], self._loss_kwargs)
            if any(t.requires_grad for t in tensor_leaves(theirs)):
                return True
        if self.schedule.sources(stage) or slot.input is None:
            return False
        return any(t.requires_grad for t in tensor_leaves(slot.input))
