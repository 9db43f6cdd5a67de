"""The event loop of the pipeline runtime: one step (or evaluation) of this rank, every
action of its schedule in order, with the receives posted ahead and a failure anywhere
turned into the error every rank raises.

:class:`StepLoop` is the part of :class:`~xgrad.torch_backend.pipeline.PipelineRuntime`
that runs a step once its arguments are split (``step``: :mod:`.pipeline_call`); it stands
on the step's private group and its failures (:class:`~.pipeline_group.StepGroups`) and on
the passes of each action (:class:`~.pipeline_stage.StagePasses`). Kept apart from
:mod:`~xgrad.torch_backend.pipeline`, which holds the runtime's class, its documentation
and its constructor (the settings it checks and keeps): what a runtime is, apart from what
it does on each step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from xgrad.failure import RankError
from xgrad.local_errors import as_local
from xgrad.pipeline import Action, Kind
from xgrad.raising import raise_from
from xgrad.torch_backend.ddp_recover import DROPPED, UNFINISHED, post_failed_passes
from xgrad.torch_backend.pipeline_ddps import ddp_steps
from xgrad.torch_backend.pipeline_group import StepGroups
from xgrad.torch_backend.pipeline_joins import StageJoins
from xgrad.torch_backend.pipeline_posted import check_release
from xgrad.torch_backend.pipeline_slot import ActionRecord, Slot, held_bytes
from xgrad.torch_backend.pipeline_stage import StagePasses
from xgrad.torch_backend.pipeline_start import next_step, step_tag

__all__ = ["StepLoop"]

_SENDS = (Kind.SEND_F, Kind.SEND_B)


class StepLoop(StepGroups, StagePasses):
    """:meth:`_run_step`: every action of this rank's schedule, in order (the runtime sets
    the attributes; :meth:`step` and :meth:`eval` call it)."""

    records: list[ActionRecord]
    peak_held_bytes: int
    _split: Callable[..., Any]  # the runtime's (pipeline_call.StepCall)

    def _run_step(self, inputs: Any, targets: Any, losses: list[Any] | None) -> Any:
        """Run one step (:meth:`step`, pipeline_call) or evaluation: every action of this
        rank, in order. Its loss on the last stage's rank (``None`` in an evaluation)."""
        sched = self.schedule
        check_release(self.release_sends, self.post_ahead)
        if UNFINISHED or DROPPED:  # a DDP's pass raised or was dropped: its peers told now
            post_failed_passes(None)
        self._ddp_steps = ddp_steps(self._ddps)
        self._start_grads()  # REDUCE_GRAD's step, the division by m (pipeline_scale)
        self._devices, self._joins, self._losses, self._outputs = {}, StageJoins(), {}, {}
        self._keyword_mbs = self._target_mbs = None
        mine = set(sched.stages_of(self.rank))
        # A batch this rank cannot split fails the step on every rank: posted before the
        # private group is made (the peers wait for it in wait_all_started), else below.
        early: Any = None
        if not (self._agreed == self._digest and self._p2p is not None):
            try:
                early = self._split(inputs, targets, mine)
            except Exception as exc:
                early = exc
        index = next_step(self.group)
        n = sched.num_stages
        self._tag = step_tag(index, n)
        channel = self._open_or_reset(index, mine, early)
        slots: dict[tuple[int, int], Slot] = {}

        def grad_shapes(stage: int, mb: int) -> Any:
            slot = slots.get((stage, mb))
            return None if slot is None else slot.grad_shapes

        self._wire = self._new_wire(channel, grad_shapes)
        action: Action | None = None
        wire = self._wire
        split = early is not None
        try:
            if early is None:
                wire.advance(0)  # receives posted first: the peers' poison is taken at once
                early = self._split(inputs, targets, mine)
                split = True
            xs, ys, self._keyword_mbs = early
            self._target_mbs = ys
            hooked = (xs, self._keyword_mbs, None if ys is None else (ys, self._loss_kwargs))
            self._know_data((inputs, targets, self._keywords, self._loss_kwargs), hooked)
            loss = None
            self.records = []
            for i, action in enumerate(self._actions):
                if action.kind not in _SENDS:  # a send goes out before receives are posted
                    wire.advance(i)
                start = time.perf_counter()
                wire.waited = 0.0
                loss = self._perform(action, slots, xs, ys, loss)
                self.records.append(ActionRecord(action, start, time.perf_counter(), wire.waited))
                # Only a pass adds to what is held; W only frees (skipping it keeps the peak).
                if action.kind.is_compute and action.kind is not Kind.BACKWARD_WEIGHT:
                    self.peak_held_bytes = max(self.peak_held_bytes, held_bytes(slots))
            action = None
            wire.finish(self._waiters[1])
            if self._written:
                self._forget()
            last = sched.num_stages - 1 in mine
            if losses is not None and last:
                losses[:] = [self._losses[mb] for mb in sorted(self._losses)]
            return None if self._evaluating else loss  # eval merges its outputs after
        except RankError as error:
            raise_from(self._failed_by(error, channel, wire, action), error)  # no cycle
        except Exception as exc:
            failure = self._fail_here(channel, wire, action, exc)
            if not split:
                raise  # this rank's own bad batch: its ValueError/TypeError, peers a RankError
            raise as_local(self._raised(failure, channel), exc) from exc
        except BaseException as exc:  # Ctrl-C, exit: the peers are told, here it stays as is
            self._fail_here(channel, wire, action, exc)
            raise
