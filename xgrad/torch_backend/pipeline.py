"""Pipeline runtime on torch.distributed: one process per rank runs its schedule's actions."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xgrad.pipeline import (
    Action,
    Invocation,
    Kind,
    Schedule,
    insert_comms,
    partitions_of,
    placement_of,
    validate,
)

__all__ = ["CHECKPOINT_MODES", "ActionRecord", "PipelineRuntime"]

#: torchgpipe's checkpointing modes: recompute the forward of every microbatch in backward,
#: of every microbatch but the last (whose backward starts right away), or of none.
CHECKPOINT_MODES = ("always", "except_last", "never")

#: dtypes an activation may have, by their code in the shape header.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
_HEADER = 10  # ndim, dtype code, up to 8 dimensions


@dataclass
class ActionRecord:
    """One executed action's wall-clock interval (seconds, ``time.perf_counter``)."""

    action: Action
    start: float
    end: float


@dataclass
class _Slot:
    """What one (stage, microbatch) keeps between its forward and its backward."""

    input: torch.Tensor | None = None  # detached, requires grad (stage > 0)
    output: torch.Tensor | None = None  # with graph (the scaled loss on the last stage)
    grad_output: torch.Tensor | None = None
    grad_input: torch.Tensor | None = None  # waiting for SEND_B
    shape: tuple[torch.Size, torch.dtype] | None = None
    rng: tuple[torch.Tensor, torch.Tensor | None] | None = None  # for the recomputation
    pending: list[Any] = field(default_factory=list)  # receive works not yet waited


class PipelineRuntime:
    """Runs this rank's part of a pipeline schedule, as an event loop over its actions.

    The first stage reads microbatches of the input, the last computes the loss on
    microbatches of the target, the middle ones receive and send; activations move with
    ``isend``/``irecv`` (gloo on CPU, NCCL on GPU) and are dropped once sent. Gradients
    accumulate into the partitions' ``.grad`` and equal those of the whole model run on the
    whole batch (each microbatch's loss is scaled by 1/m, so the loss must be a mean over
    the batch, as ``MSELoss`` and ``CrossEntropyLoss`` are by default). A stage takes one
    tensor and returns one; the first step sends each stage's activation shape once (a small
    header), so shapes must stay the same afterwards (a new shape needs a new runtime).
    A checkpointed forward is redone with the random state it first ran with.

    Attributes:
        records: the last step's actions with their wall-clock start and end.
        peak_held_bytes: the most bytes of activations and gradients held at once so far.

    Args:
        schedule: a schedule (compute-only ones get :func:`~xgrad.pipeline.insert_comms`);
            validated for blocking point-to-point, so sends and receives pair up in order.
        partitions: this rank's modules, slot ``index`` of its :class:`Location` s. Without
            ``invocations``, slot k is the k-th virtual stage placed on this rank.
        loss_fn: ``loss_fn(output, target)`` on the last stage.
        invocations: fairscale-style invocations mapping virtual stages to partitions (a
            partition may be invoked more than once; its gradient is then the sum).
        group: the pipeline process group (default: the default group); schedule rank r is
            group rank r.
        checkpoint: ``"always"``, ``"except_last"`` (default) or ``"never"``.
        timeout: seconds any receive or send may take before an error names it.
        no_sync: for data parallelism, a context factory ``no_sync(partition_index)`` under
            which forwards that must not reduce gradients run (DDP's ``no_sync``); only the
            last microbatch's forward with gradients runs outside it.
        device: where received tensors go (default: the device of the stage's parameters).

    Example:
        >>> rt = PipelineRuntime(one_f_one_b(2, 4), [stage], nn.MSELoss())  # doctest: +SKIP
        >>> loss = rt.step(x if rank == 0 else None, y if rank == 1 else None)
    """

    def __init__(
        self,
        schedule: Schedule,
        partitions: Sequence[nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        invocations: Sequence[Invocation] | None = None,
        group: Any = None,
        checkpoint: str = "except_last",
        timeout: float = 60.0,
        no_sync: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        if schedule.num_ranks != world:
            raise ValueError(
                f"rank {self.rank}: schedule has {schedule.num_ranks} ranks, the group {world}"
            )
        if not schedule.has_comms:
            schedule = insert_comms(schedule)
        self.schedule = validate(schedule, rendezvous=True)
        self.partitions = list(partitions)
        if invocations is not None:
            if placement_of(invocations) != schedule.placement:
                raise ValueError(
                    f"rank {self.rank}: invocations place stages on {placement_of(invocations)}, "
                    f"the schedule on {schedule.placement}"
                )
            self._slot_of = {s: loc.index for s, loc in enumerate(partitions_of(invocations))}
        else:
            self._slot_of = {s: k for k, s in enumerate(schedule.stages_of(self.rank))}
        mine = {self._slot_of[s] for s in schedule.stages_of(self.rank)}
        if mine and max(mine) >= len(self.partitions):
            raise ValueError(
                f"rank {self.rank}: needs partitions for slots {sorted(mine)}, "
                f"got {len(self.partitions)} partitions"
            )
        self.loss_fn = loss_fn
        self.checkpoint = checkpoint
        self.timeout = timeout
        self._no_sync = no_sync
        self.device = None if device is None else torch.device(device)
        if no_sync is not None:
            self._check_data_parallel()
        self._shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}  # stage -> its input
        self._sent_header: set[int] = set()
        self.records: list[ActionRecord] = []
        self.peak_held_bytes = 0

    def _check_data_parallel(self) -> None:
        """DDP reduces in the backward after its synchronised forward: that must be the
        stage's last backward, of the last microbatch, and a whole one (B, not I and W)."""
        if self.schedule.splits_backward:
            raise ValueError(
                f"rank {self.rank}: data parallelism (no_sync) needs full backward passes; "
                f"schedule {self.schedule.name!r} splits them into I and W"
            )
        last = self.schedule.num_microbatches - 1
        for s in self.schedule.stages_of(self.rank):
            order = [
                a.microbatch
                for a in self.schedule.actions[self.rank]
                if a.stage == s and a.kind is Kind.BACKWARD
            ]
            if order[-1] != last:
                raise ValueError(
                    f"rank {self.rank}: with data parallelism stage {s}'s last backward must be "
                    f"of microbatch {last}, got {order[-1]}"
                )

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

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise RuntimeError(
                f"rank {self.rank}: {what} failed or did not complete within {self.timeout}s: {exc}"
            ) from exc

    def _checkpointed(self, microbatch: int) -> bool:
        last = self.schedule.num_microbatches - 1
        if microbatch == last:
            # With data parallelism the last microbatch's forward is redone right before its
            # backward, so nothing else runs between DDP's synchronised forward and backward.
            return self.checkpoint == "always" or self._no_sync is not None
        return self.checkpoint != "never"

    @contextlib.contextmanager
    def _sync_context(self, stage: int, microbatch: int) -> Iterator[None]:
        last = microbatch == self.schedule.num_microbatches - 1
        if self._no_sync is None or (last and torch.is_grad_enabled()):
            yield
        else:
            with self._no_sync(self._slot_of[stage]):
                yield

    def _run_forward(self, stage: int, mb: int, x: torch.Tensor, target: Any) -> torch.Tensor:
        with self._sync_context(stage, mb):
            y = self._module(stage)(x)
        if stage == self.schedule.num_stages - 1:
            return self.loss_fn(y, target) / self.schedule.num_microbatches
        return y

    # -- the event loop ------------------------------------------------------------------

    def step(
        self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Run one step: every action of this rank, in order.

        Args:
            inputs: the whole batch, on the rank of stage 0 (ignored elsewhere).
            targets: the whole batch's targets, on the rank of the last stage.

        Returns:
            The whole batch's loss (detached) on the last stage's rank, else ``None``.
        """
        sched = self.schedule
        mine = set(sched.stages_of(self.rank))
        xs = self._split(inputs, "inputs") if 0 in mine else None
        ys = self._split(targets, "targets") if sched.num_stages - 1 in mine else None
        slots: dict[tuple[int, int], _Slot] = {}
        sends: list[tuple[Any, torch.Tensor, Action]] = []
        loss = None
        self.records = []
        for action in sched.actions[self.rank]:
            start = time.perf_counter()
            key = (action.stage, action.microbatch)
            slot = slots.setdefault(key, _Slot())
            kind = action.kind
            if kind is Kind.FORWARD:
                out = self._forward(action, slot, slots, xs, ys)
                if action.stage == sched.num_stages - 1:
                    loss = out.detach() if loss is None else loss + out.detach()
            elif kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
                self._backward(action, slot, slots, ys, weights=kind is Kind.BACKWARD)
            elif kind is Kind.BACKWARD_WEIGHT:
                self._backward_weight(action, slot)
            elif kind in (Kind.SEND_F, Kind.SEND_B):
                sends = [s for s in sends if not s[0].is_completed()]
                sends.extend(self._send(action, slot))
            else:
                self._recv(action, slot)
            self.records.append(ActionRecord(action, start, time.perf_counter()))
            self.peak_held_bytes = max(self.peak_held_bytes, _held_bytes(slots))
            if not (slot.input, slot.output, slot.grad_output, slot.grad_input, slot.pending):
                slots.pop(key, None)
        for work, _, action in sends:
            self._wait(work, f"{action} (send)")
        return loss

    def _split(self, batch: torch.Tensor | None, name: str) -> list[torch.Tensor]:
        m = self.schedule.num_microbatches
        if not isinstance(batch, torch.Tensor):
            raise TypeError(
                f"rank {self.rank}: {name} must be a tensor on this rank, got {type(batch).__name__}"
            )
        if batch.shape[0] % m:
            raise ValueError(
                f"rank {self.rank}: {name} batch size {batch.shape[0]} is not a multiple of "
                f"the {m} microbatches"
            )
        return list(batch.chunk(m))

    def _forward(
        self,
        action: Action,
        slot: _Slot,
        slots: dict[tuple[int, int], _Slot],
        xs: list[torch.Tensor] | None,
        ys: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        s, mb = action.stage, action.microbatch
        if s == 0:
            assert xs is not None
            x = xs[mb]
        else:
            prev = slots.get((s - 1, mb))
            if self.schedule.placement[s - 1] == self.rank:
                assert prev is not None and prev.output is not None
                x = prev.output.detach()
                if self._checkpointed(mb):
                    prev.output = None
            else:
                for work in slot.pending:
                    self._wait(work, f"{Action(s, Kind.RECV_F, mb)}")
                slot.pending = []
                assert slot.input is not None
                x = slot.input
            x = x.detach().requires_grad_(x.is_floating_point())
        target = ys[mb] if ys is not None and s == self.schedule.num_stages - 1 else None
        if self._checkpointed(mb):
            dev = self._device(s)
            cuda_state = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None
            slot.rng = (torch.get_rng_state(), cuda_state)
            with torch.no_grad():
                y = self._run_forward(s, mb, x, target)
        else:
            y = self._run_forward(s, mb, x, target)
        slot.input = x
        slot.shape = (y.shape, y.dtype)
        # The output is kept for the send (or the next local stage) and, without
        # checkpointing, for the backward; a send drops the checkpointed one.
        slot.output = y
        return y

    def _recompute(self, action: Action, slot: _Slot, ys: list[torch.Tensor] | None) -> None:
        """Redo the forward with the random state it first ran with (same dropout masks)."""
        s, mb = action.stage, action.microbatch
        assert slot.input is not None and slot.rng is not None
        target = ys[mb] if ys is not None and s == self.schedule.num_stages - 1 else None
        dev = self._device(s)
        cuda = [dev] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), torch.enable_grad():
            cpu_state, cuda_state = slot.rng
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, dev)
            slot.output = self._run_forward(s, mb, slot.input, target)

    def _grad_output(self, action: Action, slot: _Slot) -> torch.Tensor | None:
        s, mb = action.stage, action.microbatch
        if s == self.schedule.num_stages - 1:
            return None
        for work in slot.pending:
            self._wait(work, f"{Action(s, Kind.RECV_B, mb)}")
        slot.pending = []
        if slot.grad_output is None:
            raise RuntimeError(f"rank {self.rank}: {action} has no gradient for its output")
        return slot.grad_output

    def _backward(
        self,
        action: Action,
        slot: _Slot,
        slots: dict[tuple[int, int], _Slot],
        ys: list[torch.Tensor] | None,
        *,
        weights: bool,
    ) -> None:
        s, mb = action.stage, action.microbatch
        if self._checkpointed(mb):
            self._recompute(action, slot, ys)
        assert slot.output is not None and slot.input is not None
        g = self._grad_output(action, slot)
        x = slot.input
        if weights:
            # The input is a leaf: the whole backward leaves its gradient in ``x.grad``.
            torch.autograd.backward(slot.output, g)
            grad_in = x.grad if s > 0 else None
            slot.output = slot.input = slot.grad_output = None
        else:
            grad_in = None
            if s > 0 and x.requires_grad:
                (grad_in,) = torch.autograd.grad(slot.output, [x], g, retain_graph=True)
            slot.grad_output = g  # kept for W
        if s > 0:
            self._pass_grad(s, mb, grad_in, slots)

    def _pass_grad(
        self, s: int, mb: int, grad_in: torch.Tensor | None, slots: dict[tuple[int, int], _Slot]
    ) -> None:
        if grad_in is None:
            raise RuntimeError(
                f"rank {self.rank}: stage {s}'s output does not depend on its input "
                f"(microbatch {mb}); no gradient to pass back"
            )
        if self.schedule.placement[s - 1] == self.rank:
            slots.setdefault((s - 1, mb), _Slot()).grad_output = grad_in
        else:
            slots[(s, mb)].grad_input = grad_in

    def _backward_weight(self, action: Action, slot: _Slot) -> None:
        params = [p for p in self._module(action.stage).parameters() if p.requires_grad]
        out = slot.output
        if out is None:
            raise RuntimeError(f"rank {self.rank}: {action} runs without its I pass's graph")
        torch.autograd.backward(out, slot.grad_output, inputs=params)
        slot.output = slot.input = slot.grad_output = None

    def _send(self, action: Action, slot: _Slot) -> list[tuple[Any, torch.Tensor, Action]]:
        s = action.stage
        peer = self.schedule.placement[s + 1 if action.kind is Kind.SEND_F else s - 1]
        tensor = slot.output if action.kind is Kind.SEND_F else slot.grad_input
        if tensor is None:
            raise RuntimeError(f"rank {self.rank}: {action} has nothing to send")
        tensor = tensor.detach().contiguous()
        works = []
        if action.kind is Kind.SEND_F:
            if s not in self._sent_header:
                header = _header(tensor)
                works.append(
                    (dist.isend(header, self._peer(peer), group=self.group), header, action)
                )
                self._sent_header.add(s)
            # Without checkpointing the output's graph stays for the backward; the sent copy
            # is all the next stage sees.
            if self._checkpointed(action.microbatch):
                slot.output = None
        else:
            slot.grad_input = None  # freed once sent
        works.append((dist.isend(tensor, self._peer(peer), group=self.group), tensor, action))
        return works

    def _recv(self, action: Action, slot: _Slot) -> None:
        s = action.stage
        if action.kind is Kind.RECV_F:
            peer = self.schedule.placement[s - 1]
            if s not in self._shapes:
                header = torch.zeros(_HEADER, dtype=torch.int64, device=self._device(s))
                self._wait(
                    dist.irecv(header, self._peer(peer), group=self.group), f"{action} (shape)"
                )
                self._shapes[s] = _parse_header(header)
            shape, dtype = self._shapes[s]
            buf = torch.empty(shape, dtype=dtype, device=self._device(s))
            slot.input = buf
        else:
            peer = self.schedule.placement[s + 1]
            if slot.shape is None:
                raise RuntimeError(f"rank {self.rank}: {action} before the forward of its stage")
            shape, dtype = slot.shape
            buf = torch.empty(shape, dtype=dtype, device=self._device(s))
            slot.grad_output = buf
        slot.pending.append(dist.irecv(buf, self._peer(peer), group=self.group))


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
        raise ValueError(
            f"activation of shape {tuple(tensor.shape)} and dtype {tensor.dtype} cannot be sent "
            f"(at most {_HEADER - 2} dimensions, dtypes {_DTYPES})"
        )
    dims = [tensor.dim(), _DTYPES.index(tensor.dtype), *tensor.shape]
    return torch.tensor(dims + [0] * (_HEADER - len(dims)), dtype=torch.int64, device=tensor.device)


def _parse_header(header: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    values = header.tolist()
    ndim, code = int(values[0]), int(values[1])
    return torch.Size(int(d) for d in values[2 : 2 + ndim]), _DTYPES[code]


def _held_bytes(slots: dict[tuple[int, int], _Slot]) -> int:
    total = 0
    for slot in slots.values():
        for t in (slot.input, slot.output, slot.grad_output, slot.grad_input):
            if t is not None:
                total += t.numel() * t.element_size()
    return total
