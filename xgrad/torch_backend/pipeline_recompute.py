"""Checkpointing for the pipeline runtime: which forwards to redo, and redoing them alike.

torchgpipe's three modes decide which microbatches' forwards run without keeping their
graph and are recomputed right before their backward. A recomputed forward must draw the
same random numbers (dropout masks) as the first, so the random state is captured before
the first run and restored around the second; it must start from the buffers as the first
found them (a forward that updates a buffer it reads), so those it changed are copied
first; and it must not update the buffers again (BatchNorm's running statistics), so they
are put back after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from xgrad.pipeline import Kind, Schedule
from xgrad.torch_backend.pipeline_wire import tensor_leaves

__all__ = [
    "CHECKPOINT_MODES",
    "BufferSnapshot",
    "RngState",
    "check_data_parallel",
    "check_unchanged",
    "checkpointed",
    "kept_buffers",
    "no_activations",
    "replayed_rng",
    "versions",
]

#: recompute the forward of every microbatch in backward, of every microbatch but the last
#: (whose backward starts right away), or of none.
CHECKPOINT_MODES = ("always", "except_last", "never")


def checkpointed(mode: str, microbatch: int, num_microbatches: int, synced: bool = False) -> bool:
    """Whether microbatch ``microbatch``'s forward is recomputed in its backward.

    ``synced``: with data parallelism, the stage's synchronised microbatch (the one whose
    backward is the stage's last, :func:`check_data_parallel`), redone right before its
    backward so that nothing else runs between DDP's synchronised forward and backward.
    """
    if synced:
        return True
    if microbatch == num_microbatches - 1:
        return mode == "always"
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


def _buffer_tables(module: torch.nn.Module) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    return [
        (m._buffers, name, b)
        for m in module.modules()
        for name, b in m._buffers.items()
        if b is not None
    ]


def _copy(copies: dict[int, torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    """A copy of ``b``, one per buffer however many places share it (kept in ``copies``)."""
    if id(b) not in copies:
        copies[id(b)] = b.clone()
    return copies[id(b)]


#: a buffer's place: its module's buffer table (by identity) and its name there.
Place = tuple[int, str]


class BufferSnapshot:
    """A module's buffers as a checkpointed forward found them, kept for its recomputation.

    Taken right before the first forward; :meth:`changed` then keeps the copies of only
    the buffers that forward changed (in place, or replaced), by place (module and name:
    a buffer replaced by a later microbatch's forward is still found). A forward that
    reads a buffer it also updates (``spectral_norm``'s power-iteration vectors, a running
    scale) computed with the values from before its update, so its recomputation must
    start from those, not from what it (or a later microbatch's forward) left.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        copies: dict[int, torch.Tensor] = {}
        self._taken = [
            (table, name, b, b._version, b.data_ptr(), _copy(copies, b))
            for table, name, b in _buffer_tables(module)
        ]

    def changed(self) -> dict[Place, torch.Tensor]:
        """After the first forward: place -> the copy from before, for the places whose
        buffer the forward changed (the other copies are dropped)."""
        out = {
            (id(table), name): copy
            for table, name, b, version, ptr, copy in self._taken
            if table.get(name) is not b or b._version != version or b.data_ptr() != ptr
        }
        self._taken = []
        return out


@contextlib.contextmanager
def kept_buffers(
    module: torch.nn.Module, before: dict[Place, torch.Tensor] | None = None
) -> Iterator[None]:
    """Run the block on copies of ``module``'s buffers; the buffers stay as they were.

    A recomputed forward redoes the first one's arithmetic, not its effects: BatchNorm in
    training mode would otherwise update its running statistics (and count the batch) a
    second time, which the unpipelined model never does. The copies hold the values the
    first forward found (``before``, from :class:`BufferSnapshot`, where it changed a
    buffer; otherwise the buffer's own), so the forward computes the same; the graph may
    save them (BatchNorm saves its running statistics), which is why the buffers are
    swapped rather than written back. A buffer shared by several modules gets one copy.
    """
    before = before or {}
    kept = _buffer_tables(module)
    copies: dict[int, torch.Tensor] = {}
    for table, name, b in kept:
        copy = before.get((id(table), name))
        table[name] = _copy(copies, b) if copy is None else copy
    try:
        yield
    finally:
        for table, name, b in kept:
            table[name] = b


def check_data_parallel(schedule: Schedule, rank: int) -> dict[int, int]:
    """Each of ``rank``'s stages' synchronised microbatch under data parallelism: the one
    whose backward is the stage's last (the last microbatch's, or the first's where the
    schedule runs them backwards, looped BFS), all others run under ``no_sync``. DDP
    reduces in the backward after its synchronised forward, so it must be a whole one (B,
    not I and W). (Before, the last microbatch was taken as the synchronised one whatever
    the order, and looped BFS was refused.)"""
    if schedule.splits_backward:
        raise ValueError(
            f"rank {rank}: data parallelism (no_sync) needs full backward passes; "
            f"schedule {schedule.name!r} splits them into I and W (reduce at REDUCE_GRAD "
            "instead: dp_group with plain modules)"
        )
    synced = {}
    for action in schedule.compute(rank):
        if action.kind is Kind.BACKWARD:
            synced[action.stage] = action.microbatch  # the last one stays
    return synced


def _dropped(t: torch.Tensor) -> None:
    return None


def _never_read(packed: None) -> torch.Tensor:
    raise RuntimeError("a checkpointed forward's graph is never differentiated")


def no_activations() -> contextlib.AbstractContextManager[None]:
    """Record the graph, keep none of its activations (a first, checkpointed forward).

    Run with gradients enabled, the forward tells which outputs require a gradient (a
    float mask passed through does not, and its receiver must be free to change it in
    place), and runs as its recomputation will, in grad mode (modules that take another
    path under ``no_grad`` then compute the same numbers both times). Nothing is saved for
    the backward, as under ``no_grad``, and the graph goes with the detached output.
    """
    return torch.autograd.graph.saved_tensors_hooks(_dropped, _never_read)


def _labelled(tree: Any, keywords: dict[str, Any] | None) -> list[tuple[str, torch.Tensor]]:
    """The tensor leaves of a forward's input and keywords, each with where it is."""
    found = [(f"tensor leaf {i} of the input", t) for i, t in enumerate(tensor_leaves(tree))]
    for name, value in (keywords or {}).items():
        leaves = enumerate(tensor_leaves(value))
        found += [(f"tensor leaf {j} of keyword {name!r}", t) for j, t in leaves]
    return found


def versions(tree: Any, keywords: dict[str, Any] | None = None) -> list[int]:
    """The version counters of the tensor leaves of ``tree`` and then ``keywords`` (an
    in-place change bumps one)."""
    return [t._version for _, t in _labelled(tree, keywords)]


def check_unchanged(
    what: str, tree: Any, before: list[int], mode: str, keywords: dict[str, Any] | None = None
) -> None:
    """Refuse a checkpointed forward that changed its input (or a keyword) in place.

    Its recomputation, right before the backward, runs on the same input, which by then
    holds the changed values: the gradients would be those of another forward, without a
    word (the loss, from the first run, stays right). Raised naming the input's position.
    """
    for (where, t), old in zip(_labelled(tree, keywords), before, strict=True):
        if t._version != old:
            raise RuntimeError(
                f"{what} changed its input in place ({where}, shape "
                f"{tuple(t.shape)}, {t.dtype}): with checkpoint={mode!r} this forward runs "
                "again on that input before its backward, where it would see the changed "
                "values and give wrong gradients; change a copy in the stage (x = x.clone()) "
                "or use checkpoint='never'"
            )
