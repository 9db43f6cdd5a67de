"""The backward passes of one pipeline stage on one microbatch: B, I (the input's
gradient, with the joins W will start from) and W (the weights'), the recompute a
checkpointed backward begins with, and the gradient of the output they start from.

Kept apart from :mod:`~xgrad.torch_backend.pipeline_stage`, which runs the forward, the
sends and receives, and dispatches each action (``_perform``): these are what a backward
action does to a slot once it is dispatched, the passes that differentiate.
"""

from __future__ import annotations

from typing import Any

import torch

from xgrad.pipeline import Action
from xgrad.torch_backend.pipeline_joins import Captured, run_weight
from xgrad.torch_backend.pipeline_recompute import kept_buffers, replayed_rng
from xgrad.torch_backend.pipeline_slot import Slot, summed, with_grads, zeros_for_none
from xgrad.torch_backend.pipeline_stage_base import StageState
from xgrad.torch_backend.pipeline_wire import differentiable, tensor_leaves

__all__ = ["BackwardPasses"]


class BackwardPasses(StageState):
    """The backward actions on this rank's stages (the runtime sets the attributes)."""

    w_from_joins = True  # False: W runs backward from the output (the A/B's old side)

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
        if self._checkpointed(s, mb):
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
                # A batch with a graph upstream (``base * scale``), or a tensor computed
                # before the step that the stage reads, shares that graph between the
                # microbatches: the first backward freed it for the others.
                keep = self._takes_batch_grad(s, slot, mb) or self._shares(s)
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
                    at_joins: list[torch.Tensor | None] = list(got[len(flat) :])
                    slot.captured = Captured(joins[0], edges, at_joins, self._shares(s))
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
            elif outs and params:  # (a graph made before the step kept for the others)
                keep = self._shares(action.stage)
                torch.autograd.backward(outs, grads, inputs=params, retain_graph=keep)
        slot.output = slot.input = slot.out_edges = slot.grad_output = slot.captured = None
