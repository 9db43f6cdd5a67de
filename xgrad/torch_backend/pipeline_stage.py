"""The passes of one pipeline stage on one microbatch, and the slots that hold their state.

:class:`StagePasses` is the part of :class:`~xgrad.torch_backend.pipeline.PipelineRuntime`
that runs one action (a forward, a backward, a weight pass, a send, a receive); the runtime's
event loop, its failure handling and its checks are in :mod:`~xgrad.torch_backend.pipeline`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xgrad.failure import FailureChannel
from xgrad.pipeline import Action, Kind, Schedule
from xgrad.torch_backend.failure import Waiter, wait_work
from xgrad.torch_backend.pipeline_recompute import RngState, checkpointed, replayed_rng
from xgrad.torch_backend.pipeline_wire import (
    Description,
    EdgeCache,
    carried,
    detach_tree,
    differentiable,
    empty_leaves,
    mark_gradients,
    p2p,
    rebuild,
    send_header_recv,
    tensor_leaves,
)

__all__ = ["Slot", "StagePasses", "held_bytes"]


@dataclass
class Slot:
    """What one (stage, microbatch) keeps between its forward and its backward."""

    input: Any = None  # pytree, detached leaves (those that carry a gradient require one)
    output: Any = None  # pytree with graph (the scaled loss on the last stage)
    carry: list[bool] | None = None  # per tensor leaf of the output: carries a gradient
    sent: Description | None = None  # what the forward sent (shapes of the gradients back)
    grad_output: list[torch.Tensor] | None = None
    grad_input: list[torch.Tensor] | None = None  # waiting for SEND_B
    # a forward message being received: its description, leaf buffers and their receives
    header: tuple[Description, list[torch.Tensor], list[Any]] | None = None
    rng: RngState | None = None  # for the recomputation
    pending: list[Any] = field(default_factory=list)  # gradient receives not yet waited

    def empty(self) -> bool:
        return (
            self.input is None
            and self.output is None
            and self.grad_output is None
            and self.grad_input is None
            and self.header is None
            and not self.pending
        )


class StagePasses:
    """One action at a time on this rank's stages (the runtime sets the attributes)."""

    schedule: Schedule
    partitions: list[nn.Module]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    group: Any
    rank: int
    checkpoint: str
    timeout: float
    device: torch.device | None
    _slot_of: dict[int, int]
    _no_sync: Callable[[int], contextlib.AbstractContextManager[Any]] | None
    _edges: EdgeCache
    _channel: FailureChannel | None
    _tag: int
    _waiters: tuple[Waiter, Waiter]

    # -- helpers -------------------------------------------------------------------------

    def _module(self, stage: int) -> nn.Module:
        return self.partitions[self._slot_of[stage]]

    def _device(self, stage: int) -> torch.device:
        if self.device is not None:
            return self.device
        param = next(self._module(stage).parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _post(
        self, op: Callable[..., Any], peer_rank: int, *, forward: bool
    ) -> Callable[[torch.Tensor], Any]:
        """Send or receive on one edge direction: activations and gradients travel under
        their own tags, each in the order the schedule sends them."""
        return p2p(op, self._peer(peer_rank), self.group, 2 * self._tag + (0 if forward else 1))

    def _wait(self, work: Any, what: str) -> None:
        wait_work(work, self._channel, timeout=self.timeout, what=what, waiter=self._waiters[0])

    def _checkpointed(self, microbatch: int) -> bool:
        return checkpointed(
            self.checkpoint, microbatch, self.schedule.num_microbatches, self._no_sync is not None
        )

    @contextlib.contextmanager
    def _sync_context(self, stage: int, microbatch: int) -> Iterator[None]:
        last = microbatch == self.schedule.num_microbatches - 1
        if self._no_sync is None or (last and torch.is_grad_enabled()):
            yield
        else:
            with self._no_sync(self._slot_of[stage]):
                yield

    def _run_forward(self, stage: int, mb: int, x: Any, target: Any) -> Any:
        with self._sync_context(stage, mb):
            y = self._module(stage)(x)
        if stage == self.schedule.num_stages - 1:
            return self.loss_fn(y, target) / self.schedule.num_microbatches
        return y

    def _forward(
        self,
        action: Action,
        slot: Slot,
        slots: dict[tuple[int, int], Slot],
        xs: list[Any] | None,
        ys: list[Any] | None,
    ) -> Any:
        s, mb = action.stage, action.microbatch
        if s == 0:
            assert xs is not None
            x = xs[mb]
        elif self.schedule.placement[s - 1] == self.rank:
            prev = slots.get((s - 1, mb))
            assert prev is not None and prev.output is not None
            assert prev.carry is not None
            x = detach_tree(prev.output, prev.carry)
            if self._checkpointed(mb):
                prev.output = None
        else:
            x = self._receive_forward(action, slot)
        target = ys[mb] if ys is not None and s == self.schedule.num_stages - 1 else None
        graph = not self._checkpointed(mb)
        if not graph:
            slot.rng = RngState.capture(self._device(s))
            with torch.no_grad():
                y = self._run_forward(s, mb, x, target)
        else:
            y = self._run_forward(s, mb, x, target)
        slot.carry = carried(y, graph)
        slot.input = x
        # Kept for the send (or the next local stage) and, without checkpointing, for the
        # backward; a send drops the checkpointed one.
        slot.output = y
        return y

    def _receive_forward(self, action: Action, slot: Slot) -> Any:
        s = action.stage
        recv = Action(s, Kind.RECV_F, action.microbatch)
        if slot.header is None:
            raise RuntimeError(f"{action} runs before {recv}")
        description, tensors, works = slot.header
        slot.header = None
        for w in works:
            self._wait(w, str(recv))
        mark_gradients(description, tensors)
        return rebuild(description, tensors)

    def _recompute(self, action: Action, slot: Slot, ys: list[Any] | None) -> None:
        """Redo the forward with the random state it first ran with (same dropout masks)."""
        s, mb = action.stage, action.microbatch
        assert slot.rng is not None
        target = ys[mb] if ys is not None and s == self.schedule.num_stages - 1 else None
        with replayed_rng(slot.rng), torch.enable_grad():
            slot.output = self._run_forward(s, mb, slot.input, target)

    def _grad_output(self, action: Action, slot: Slot) -> list[torch.Tensor] | None:
        s, mb = action.stage, action.microbatch
        if s == self.schedule.num_stages - 1:
            return None
        for work in slot.pending:
            self._wait(work, str(Action(s, Kind.RECV_B, mb)))
        slot.pending = []
        if slot.grad_output is None:
            raise RuntimeError(f"{action} has no gradient for its output")
        return slot.grad_output

    def _pairs(
        self, action: Action, slot: Slot, grads: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The outputs to differentiate and their incoming gradients, paired up: the leaves
        that carry a gradient, less those the (re)computed output does not make depend on
        anything that requires one."""
        if action.stage == self.schedule.num_stages - 1:
            return [slot.output], None
        assert slot.carry is not None and grads is not None
        outs = [t for t, c in zip(tensor_leaves(slot.output), slot.carry, strict=True) if c]
        kept = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
        return [o for o, _ in kept], [g for _, g in kept]

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
        if slot.output is None:
            raise RuntimeError(f"{action} runs without the output of {Action(s, Kind.FORWARD, mb)}")
        outs, grads = self._pairs(action, slot, self._grad_output(action, slot))
        ins = differentiable(slot.input) if s > 0 else []
        if weights:
            # The inputs are leaves: the whole backward leaves their gradients in ``.grad``.
            if outs:
                torch.autograd.backward(outs, grads)
            grad_in = [x.grad if x.grad is not None else torch.zeros_like(x) for x in ins]
            slot.output = slot.input = slot.grad_output = None
        else:
            grad_in = []
            if ins and outs:
                found = torch.autograd.grad(outs, ins, grads, retain_graph=True, allow_unused=True)
                grad_in = [
                    g if g is not None else torch.zeros_like(x)
                    for g, x in zip(found, ins, strict=True)
                ]
            else:
                grad_in = [torch.zeros_like(x) for x in ins]
            slot.grad_output = grads  # kept for W (paired with the outputs that need one)
        if s > 0:
            if self.schedule.placement[s - 1] == self.rank:
                slots.setdefault((s - 1, mb), Slot()).grad_output = [g.detach() for g in grad_in]
            else:
                slot.grad_input = [g.detach() for g in grad_in]

    def _backward_weight(self, action: Action, slot: Slot) -> None:
        params = [p for p in self._module(action.stage).parameters() if p.requires_grad]
        if slot.output is None:
            raise RuntimeError(f"{action} runs without its I pass's graph")
        if action.stage == self.schedule.num_stages - 1:
            outs, grads = [slot.output], None
        else:
            assert slot.carry is not None
            leaves = [t for t, c in zip(tensor_leaves(slot.output), slot.carry, strict=True) if c]
            outs = [o for o in leaves if o.requires_grad]
            grads = slot.grad_output
        if outs and params:
            torch.autograd.backward(outs, grads, inputs=params)
        slot.output = slot.input = slot.grad_output = None

    def _send(self, action: Action, slot: Slot) -> list[tuple[Any, torch.Tensor]]:
        s = action.stage
        if action.kind is Kind.SEND_F:
            peer = self.schedule.placement[s + 1]
            if slot.output is None:
                raise RuntimeError(f"{action} has nothing to send")
            post = self._post(dist.isend, peer, forward=True)
            assert slot.carry is not None
            works = self._edges.send(
                ("out", s), slot.output, slot.carry, post, str(action), self._device(s)
            )
            slot.sent = self._edges.last(("out", s))
            # Without checkpointing the output's graph stays for the backward; the sent copy
            # is all the next stage sees.
            if self._checkpointed(action.microbatch):
                slot.output = None
            return works
        if slot.grad_input is None:
            raise RuntimeError(f"{action} has nothing to send")
        post = self._post(dist.isend, self.schedule.placement[s - 1], forward=False)
        grads, slot.grad_input = slot.grad_input, None  # freed once sent
        return [(post(g.contiguous()), g) for g in grads]

    def _recv(self, action: Action, slot: Slot) -> None:
        s = action.stage
        if action.kind is Kind.RECV_F:
            # The header (and a changed description) is awaited here, where the schedule
            # receives; the leaves' receives are posted and awaited by the forward. Every
            # receive from a peer is posted in the order the peer sends.
            post = self._post(dist.irecv, self.schedule.placement[s - 1], forward=True)
            header = send_header_recv(self._device(s))
            self._wait(post(header), f"{action} (header)")
            description = self._edges.receive_description(
                ("in", s), header, post, lambda w, what: self._wait(w, f"{action} ({what})")
            )
            tensors = empty_leaves(description, self._device(s))
            slot.header = (description, tensors, [post(t) for t in tensors])
            return
        post = self._post(dist.irecv, self.schedule.placement[s + 1], forward=False)
        if slot.sent is None:
            raise RuntimeError(f"{action} before the forward of its stage was sent")
        dev = self._device(s)
        bufs = [
            torch.empty(shape, dtype=dtype, device=dev)
            for shape, dtype in slot.sent.gradient_shapes
        ]
        slot.grad_output = bufs
        slot.pending.extend(post(b) for b in bufs)


def held_bytes(slots: dict[tuple[int, int], Slot]) -> int:
    total = 0
    for slot in slots.values():
        for tree in (slot.input, slot.output, slot.grad_output, slot.grad_input):
            total += sum(t.numel() * t.element_size() for t in tensor_leaves(tree))
    return total
