"""The passes of one pipeline stage on one microbatch, and the slots that hold their state.

:class:`StagePasses` is the part of :class:`~xgrad.torch_backend.pipeline.PipelineRuntime`
that runs one action (a forward, a backward, a weight pass, a send, a receive); the backward
passes are :mod:`~xgrad.torch_backend.pipeline_backward`; the runtime's event loop is in
:mod:`~xgrad.torch_backend.pipeline_loop`, its failure handling in
:mod:`~xgrad.torch_backend.pipeline_failed`, its checks in
:mod:`~xgrad.torch_backend.pipeline_args`; the settings and helpers the passes share in
:mod:`~xgrad.torch_backend.pipeline_stage_base`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from xgrad.pipeline import Action, Kind
from xgrad.torch_backend.pipeline_backward import BackwardPasses
from xgrad.torch_backend.pipeline_recompute import (
    BufferSnapshot,
    RngState,
    check_unchanged,
    no_activations,
    versions,
)
from xgrad.torch_backend.pipeline_shared_graph import explained
from xgrad.torch_backend.pipeline_slot import Slot
from xgrad.torch_backend.pipeline_wire import (
    carried,
    detach_tree,
    tensor_leaves,
)

__all__ = ["StagePasses"]

_BACKWARDS = (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)


class StagePasses(BackwardPasses):
    """One action at a time on this rank's stages (the runtime sets the attributes)."""

    def _forward(
        self,
        action: Action,
        slot: Slot,
        slots: dict[tuple[int, int], Slot],
        xs: list[Any] | None,
        ys: list[Any] | None,
    ) -> Any:
        s, mb = action.stage, action.microbatch
        sched = self.schedule
        if s == 0:
            assert xs is not None
            x = xs[mb]
        else:
            parts = []
            for src in sched.sources(s):
                if sched.placement[src] == self.rank:
                    prev = slots.get((src, mb))
                    if prev is None or prev.output is None or prev.carry is None:
                        raise RuntimeError(f"{action} runs before {Action(src, Kind.FORWARD, mb)}")
                    parts.append(detach_tree(prev.output, prev.carry))
                    self._read(prev)
                else:
                    parts.append(self._receive_forward(action, slot, src))
            x = parts[0] if len(parts) == 1 else tuple(parts)
        target = ys[mb] if ys is not None and s == sched.num_stages - 1 else None
        graph = not self._checkpointed(s, mb)
        if graph:
            y = self._run_forward(s, mb, x, target)
            slot.carry = carried(y)
        else:
            slot.rng = RngState.capture(self._device(s))
            buffers = BufferSnapshot(self._module(s))
            kw = self._keywords_of(mb)
            before = versions(x, kw)
            if self._data_parallel(s):
                # DDP: a forward in grad mode would be waited for by its reducer.
                with torch.no_grad():
                    y = self._run_forward(s, mb, x, target)
                slot.carry = carried(y, graph=False, inputs=x)
            else:
                with torch.enable_grad(), no_activations():
                    y = self._run_forward(s, mb, x, target)
                slot.carry = carried(y)
                y = detach_tree(y, [False] * len(slot.carry))  # its graph goes
            slot.buffers = buffers.changed()
            check_unchanged(f"{action}: stage {s}'s forward", x, before, self.checkpoint, kw)
        carried_leaves = [t for t, c in zip(tensor_leaves(y), slot.carry, strict=True) if c]
        slot.grad_shapes = [(t.shape, t.dtype) for t in carried_leaves]
        slot.input = x
        slot.output = y
        users = sched.consumers(s)
        local = sum(sched.placement[t] == self.rank for t in users)
        slot.readers = local + (1 if local < len(users) else 0)
        if graph and users:
            slot.kept = [i for i, t in enumerate(carried_leaves) if t.requires_grad]
            if slot.kept:
                slot.out_edges = [get_gradient_edge(carried_leaves[i]) for i in slot.kept]
        return y

    def _read(self, slot: Slot) -> None:
        """One reader (a local consumer, or the send) took the output; after the last the
        output is dropped: recomputed if checkpointed, else its graph lives on in its edges."""
        slot.readers -= 1
        if slot.readers <= 0:
            slot.output = None

    def _receive_forward(self, action: Action, slot: Slot, source: int) -> Any:
        return self._wire.receive_forward(action, source)

    def _send(self, action: Action, slot: Slot) -> None:
        if action.kind is Kind.SEND_F:
            if slot.output is None or slot.carry is None:
                raise RuntimeError(f"{action} has nothing to send")
            self._wire.send_forward(action, slot.output, slot.carry)
            self._read(slot)  # the sent copies are all the consumers see
            return
        if slot.grad_input is None:
            raise RuntimeError(f"{action} has nothing to send")
        self._wire.send_backward(action, slot.grad_input, slot.grad_layout)
        slot.grad_input = slot.grad_layout = None  # freed once sent

    def _recv(self, action: Action) -> None:
        """Post the receive if it is not posted yet; its data is awaited where it is used."""
        self._wire.ensure(action)

    def _perform(  # one action of the event loop (PipelineRuntime.step)
        self,
        action: Action,
        slots: dict[tuple[int, int], Slot],
        xs: list[Any] | None,
        ys: list[Any] | None,
        loss: torch.Tensor | None,
    ) -> torch.Tensor | None:
        kind = action.kind
        if kind.is_stage_op:
            slot_index = self._slot_of[action.stage]
            if kind is Kind.REDUCE_GRAD and self._reduce_at.get(slot_index) == action.stage:
                if self._reduce_grad is not None:
                    self._reduce_grad(slot_index)
                elif self._dp_group is not None:
                    self._average_grads(action)
                if self._scaling is not None:
                    self._scaling.after(action)  # after the reduction, as torch's
            return loss  # UNSHARD / RESHARD: nothing is sharded here
        key = (action.stage, action.microbatch)
        slot = slots.setdefault(key, Slot())
        if kind is Kind.FORWARD:
            out = self._forward(action, slot, slots, xs, ys)
            if self._evaluating:  # no backward: the input goes, the output once read
                slot.input = None
                if action.stage == self.schedule.num_stages - 1:
                    slot.output = None  # kept in _outputs
            elif action.stage == self.schedule.num_stages - 1:
                part = out.detach()  # the step's loss: the sum of each one's over m
                if self.scale_grads and not self._loss_scaled():  # (else divided already)
                    part = part / self.schedule.num_microbatches
                loss = part if loss is None else loss + part
        elif kind in _BACKWARDS:  # B, I or W (the step's first one sets gradients aside)
            if self._scaling is not None:  # the step's own tensors: what reaches them divided
                theirs = None if ys is None else (ys, self._loss_kwargs)  # (the last stage's)
                self._scaling.begin((xs, self._keyword_mbs, theirs))
            try:
                if kind is Kind.BACKWARD_WEIGHT:
                    self._backward_weight(action, slot)
                else:
                    self._backward(action, slot, slots, ys, weights=kind is Kind.BACKWARD)
            except RuntimeError as exc:  # a graph made before the step, seen too late
                why = explained(exc, action.stage, action.microbatch)
                if why is None:
                    raise
                raise why from exc
            if self._scaling is not None:
                self._scaling.after(action)
        elif kind in (Kind.SEND_F, Kind.SEND_B):
            self._send(action, slot)
        else:
            self._recv(action)
        if slot.empty():
            slots.pop(key, None)
        return loss
