"""The passes of one pipeline stage on one microbatch, and the slots that hold their state.

:class:`StagePasses` is the part of :class:`~xgrad.torch_backend.pipeline.PipelineRuntime`
that runs one action (a forward, a backward, a weight pass, a send, a receive); the runtime's
event loop, its failure handling and its checks are in :mod:`~xgrad.torch_backend.pipeline`;
the settings and helpers the passes share in :mod:`~xgrad.torch_backend.pipeline_stage_base`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from xgrad.pipeline import Action, Kind
from xgrad.torch_backend.pipeline_joins import Captured, run_weight
from xgrad.torch_backend.pipeline_recompute import (
    BufferSnapshot,
    RngState,
    check_unchanged,
    kept_buffers,
    no_activations,
    replayed_rng,
    versions,
)
from xgrad.torch_backend.pipeline_slot import Slot, summed, with_grads, zeros_for_none
from xgrad.torch_backend.pipeline_stage_base import StageState
from xgrad.torch_backend.pipeline_wire import (
    carried,
    detach_tree,
    differentiable,
    tensor_leaves,
)

__all__ = ["StagePasses"]

_BACKWARDS = (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)


class StagePasses(StageState):
    """One action at a time on this rank's stages (the runtime sets the attributes)."""

    w_from_joins = True  # False: W runs backward from the output (the A/B's old side)

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
        graph = not self._checkpointed(mb)
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

    def _recompute(self, action: Action, slot: Slot, ys: list[Any] | None) -> None:
        """Redo the forward with the random state and buffers it first ran with (same
        dropout masks, same running statistics read)."""
        s, mb = action.stage, action.microbatch
        assert slot.rng is not None
        target = ys[mb] if ys is not None and s == self.schedule.num_stages - 1 else None
        before, slot.buffers = slot.buffers, None
        with replayed_rng(slot.rng), kept_buffers(self._module(s), before), torch.enable_grad():
            slot.output = self._run_forward(s, mb, slot.input, target)

    def _grad_output(self, action: Action, slot: Slot) -> list[torch.Tensor | None] | None:
        """The gradient of the output: the sum over every consumer's contribution."""
        s = action.stage
        if s == self.schedule.num_stages - 1:
            return None
        if any(self.schedule.placement[t] != self.rank for t in self.schedule.consumers(s)):
            slot.grad_parts += self._wire.receive_backward(action)
        if len(slot.grad_parts) < len(self.schedule.consumers(s)):
            raise RuntimeError(f"{action} has no gradient for its output from every consumer")
        total = summed(slot.grad_parts)
        slot.grad_parts = []
        if any(g is None for g in total) and self._data_parallel(s):
            # DDP: its reducer needs every parameter its forward reached
            assert slot.grad_shapes is not None
            total = zeros_for_none(total, slot.grad_shapes, self._device(s))
        return total

    def _targets(
        self, action: Action, slot: Slot, grads: list[torch.Tensor | None] | None
    ) -> tuple[list[Any], list[torch.Tensor] | None]:
        """What to differentiate and with which incoming gradients: the loss; the output's
        gradient edges (the output itself dropped once read); or the (recomputed) output
        leaves that carry a gradient and depend on something that requires one. Leaves
        whose gradient is None are left out."""
        if action.stage == self.schedule.num_stages - 1:
            return [slot.output], None
        assert grads is not None
        if slot.output is None:  # not checkpointed: its edges stand for it
            if slot.out_edges is None:
                return [], None
            assert slot.kept is not None
            return with_grads(slot.out_edges, [grads[i] for i in slot.kept])
        assert slot.carry is not None
        outs = [t for t, c in zip(tensor_leaves(slot.output), slot.carry, strict=True) if c]
        kept = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
        return with_grads([o for o, _ in kept], [g for _, g in kept])

    def _backward(
        self,
        action: Action,
        slot: Slot,
        slots: dict[tuple[int, int], Slot],
        ys: list[Any] | None,
        *,
        weights: bool,
    ) -> None:
        s, mb = action.stage, action.microbatch
        if self._checkpointed(mb):
            self._recompute(action, slot, ys)
        elif slot.output is not None and slot.out_edges is not None:
            slot.output = None  # the edges are the graph
        grads = self._grad_output(action, slot)
        outs, out_grads = self._targets(action, slot, grads)
        sources = self.schedule.sources(s)
        trees = [] if not sources else [slot.input] if len(sources) == 1 else list(slot.input)
        ins = [differentiable(t) for t in trees]
        flat = [x for group in ins for x in group]
        if weights:
            # The inputs are leaves: the whole backward leaves their gradients in ``.grad``.
            if outs:
                # A batch with a graph upstream (``base * scale``) shares it between the
                # microbatches: the first backward freed it for the others.
                keep = self._takes_batch_grad(s, slot, mb)
                torch.autograd.backward(outs, out_grads, retain_graph=keep)
            found: list[torch.Tensor | None] = [x.grad for x in flat]
            slot.output = slot.input = slot.out_edges = slot.grad_output = None
        else:
            found = [None] * len(flat)
            if flat and outs:
                # W's starting points (see pipeline_joins), captured by the same call; none
                # where W must reach a keyword that requires grad too (its whole backward).
                joins = (
                    self._joins.edges(s, outs, flat, self._params(s))
                    if self.w_from_joins and not self._takes_batch_grad(s, slot, mb)
                    else None
                )
                edges = [] if joins is None else joins[1]
                got = torch.autograd.grad(
                    outs, [*flat, *edges], out_grads, retain_graph=True, allow_unused=True
                )
                found = list(got[: len(flat)])
                if joins is not None:  # W needs only the joins: the graph above them goes
                    slot.captured = Captured(joins[0], edges, list(got[len(flat) :]))
                    slot.output = slot.out_edges = None
            slot.grad_output = grads if slot.captured is None else None  # kept for W
        # An input that got no gradient sends none (not zeros): upstream, what reaches
        # only it keeps ``.grad`` None, as in the unpipelined model.
        grad_in = [None if g is None else g.detach() for g in found]
        start = 0
        for src, group in zip(sources, ins, strict=True):
            mine, start = grad_in[start : start + len(group)], start + len(group)
            if self.schedule.placement[src] == self.rank:
                slots.setdefault((src, mb), Slot()).grad_parts.append(mine)
            else:
                slot.grad_input = slot.grad_input or {}
                slot.grad_input[src] = mine
                if any(g is None for g in mine):
                    slot.grad_layout = slot.grad_layout or {}
                    slot.grad_layout[src] = [(x.shape, x.dtype) for x in group]

    def _backward_weight(self, action: Action, slot: Slot) -> None:
        if slot.output is None and slot.out_edges is None and slot.captured is None:
            if slot.kept == []:
                # No output leaf required grad (a frozen or parameter-free stage, integer
                # outputs): no gradient reaches the weights, and W has nothing to do, as
                # B would not; its graph went with the output once sent.
                slot.input = slot.grad_output = None
                return
            raise RuntimeError(f"{action} runs without its I pass's graph")
        if slot.captured is not None:
            run_weight(slot.captured)  # from where the parameters join (the I pass's record)
        else:
            params = self._params(action.stage)()
            if action.stage == self.schedule.num_stages - 1:
                outs, grads = [slot.output], None
            else:
                outs, grads = self._targets(action, slot, slot.grad_output)
            if outs and self._takes_batch_grad(action.stage, slot, action.microbatch):
                # The step's own input requires grad (an adversarial input, a penalty on
                # it): I had nothing of this stage's to differentiate, so W takes the
                # whole backward, into the batch too, as B would (else its .grad stayed
                # None, or partial where some microbatches ran B and others I/W).
                torch.autograd.backward(outs, grads, retain_graph=True)  # shared upstream
            elif outs and params:
                torch.autograd.backward(outs, grads, inputs=params)
        slot.output = slot.input = slot.out_edges = slot.grad_output = slot.captured = None

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
            if self._scaling is not None:
                self._scaling.begin((xs, self._keyword_mbs))
            if kind is Kind.BACKWARD_WEIGHT:
                self._backward_weight(action, slot)
            else:
                self._backward(action, slot, slots, ys, weights=kind is Kind.BACKWARD)
            if self._scaling is not None:
                self._scaling.after(action)
        elif kind in (Kind.SEND_F, Kind.SEND_B):
            self._send(action, slot)
        else:
            self._recv(action)
        if slot.empty():
            slots.pop(key, None)
        return loss
