"""Checkpointing for the pipeline runtime: which forwards to redo, and redoing them alike.

torchgpipe's three modes decide which microbatches' forwards run without keeping their
graph and are recomputed right before their backward. A recomputed forward must draw the
same random numbers (dropout masks) as the first, so the random state is captured before
the first run and restored around the second; and it must not update the buffers again
(BatchNorm's running statistics), so they are put back after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from xgrad.pipeline import Kind, Schedule

__all__ = [
    "CHECKPOINT_MODES",
    "RngState",
    "check_data_parallel",
    "checkpointed",
    "kept_buffers",
    "replayed_rng",
]

#: recompute the forward of every microbatch in backward, of every microbatch but the last
#: (whose backward starts right away), or of none.
CHECKPOINT_MODES = ("always", "except_last", "never")


def checkpointed(mode: str, microbatch: int, num_microbatches: int, data_parallel: bool) -> bool:
    """Whether microbatch ``microbatch``'s forward is recomputed in its backward.

    With data parallelism the last microbatch's forward is redone right before its backward,
    so nothing else runs between DDP's synchronised forward and backward.
    """
    if microbatch == num_microbatches - 1:
        return mode == "always" or data_parallel
    return mode != "never"


@dataclass(frozen=True)
class RngState:
    """The CPU (and, for a CUDA stage, that device's) random state before a forward."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)


@contextlib.contextmanager
def replayed_rng(state: RngState) -> Iterator[None]:
    """Run the block with ``state``'s random state; the caller's state is left untouched."""
    devices = [state.device] if state.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state.cpu)
        if state.cuda is not None:
            torch.cuda.set_rng_state(state.cuda, state.device)
        yield


@contextlib.contextmanager
def kept_buffers(module: torch.nn.Module) -> Iterator[None]:
    """Run the block on copies of ``module``'s buffers; the buffers stay as they were.

    A recomputed forward redoes the first one's arithmetic, not its effects: BatchNorm in
    training mode would otherwise update its running statistics (and count the batch) a
    second time, which the unpipelined model never does. The copies hold the same values,
    so the forward computes the same; the graph may save them (BatchNorm saves its running
    statistics), which is why the buffers are swapped rather than written back.
    """
    kept = [(m._buffers, name, b) for m in module.modules() for name, b in m._buffers.items()]
    for table, name, b in kept:
        if b is not None:
            table[name] = b.clone()
    try:
        yield
    finally:
        for table, name, b in kept:
            table[name] = b


def check_data_parallel(schedule: Schedule, rank: int) -> None:
    """DDP reduces in the backward after its synchronised forward (the last microbatch's,
    redone right before its backward): that must be the stage's last backward, of the last
    microbatch, and a whole one (B, not I and W)."""
    if schedule.splits_backward:
        raise ValueError(
            f"rank {rank}: data parallelism (no_sync) needs full backward passes; "
            f"schedule {schedule.name!r} splits them into I and W"
        )
    last = schedule.num_microbatches - 1
    for s in schedule.stages_of(rank):
        order = [
            a.microbatch for a in schedule.compute(rank) if a.stage == s and a.kind is Kind.BACKWARD
        ]
        if order[-1] != last:
            raise ValueError(
                f"rank {rank}: with data parallelism stage {s}'s last backward must be "
                f"of microbatch {last}, got {order[-1]}"
            )
