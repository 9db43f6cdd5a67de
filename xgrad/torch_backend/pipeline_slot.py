"""What the pipeline runtime keeps: per (stage, microbatch) between its forward and its
backward, and the record of each executed action."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from xgrad.pipeline import Action
from xgrad.torch_backend.pipeline_joins import Captured
from xgrad.torch_backend.pipeline_recompute import RngState
from xgrad.torch_backend.pipeline_wire import tensor_leaves

__all__ = ["ActionRecord", "Slot", "held_bytes", "summed", "with_grads", "zeros_for_none"]


@dataclass
class ActionRecord:
    """One executed action's wall-clock interval (seconds, ``time.perf_counter``) and the
    seconds of it spent blocked on a message from another rank (``waited``)."""

    action: Action
    start: float
    end: float
    waited: float = 0.0


@dataclass
class Slot:
    """What one (stage, microbatch) keeps between its forward and its backward."""

    input: Any = None  # pytree, detached leaves (those that carry a gradient require one)
    output: Any = None  # pytree with graph (the scaled loss on the last stage)
    carry: list[bool] | None = None  # per tensor leaf of the output: carries a gradient
    # shape and dtype of each output leaf that carries a gradient (what comes back)
    grad_shapes: list[tuple[torch.Size, torch.dtype]] | None = None
    readers: int = 0  # local consumers and a send still to read the output
    # Without checkpointing: the gradient edges of the output leaves (their graph nodes
    # without the tensors), so the output itself is dropped once read (fairscale's
    # AutogradWithoutActivations, there with a phony autograd node; the edges cost less).
    out_edges: list[GradientEdge] | None = None
    kept: list[int] | None = None  # which carried leaves the edges stand for
    # Gradients are None where the output leaf got none (a consumer ignored it).
    grad_parts: list[list[torch.Tensor | None]] = field(default_factory=list)  # summed at B
    grad_output: list[torch.Tensor | None] | None = None  # the sum, kept between I and W
    captured: Captured | None = None  # or, from the I pass, where W starts and with what
    grad_input: dict[int, list[torch.Tensor | None]] | None = None  # per remote source
    # per remote source whose gradients include None: shape and dtype per leaf (SEND_B)
    grad_layout: dict[int, list[tuple[torch.Size, torch.dtype]]] | None = None
    rng: RngState | None = None  # for the recomputation
    # for the recomputation: the buffers the first forward changed, as it found them
    buffers: dict[tuple[int, str], torch.Tensor] | None = None

    def empty(self) -> bool:
        return (
            self.input is None
            and self.output is None
            and self.out_edges is None
            and not self.grad_parts
            and self.grad_output is None
            and self.captured is None
            and self.grad_input is None
        )


def summed(parts: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """Per output leaf, the sum of the consumers' gradients (None: none gave one)."""
    out: list[torch.Tensor | None] = []
    for gs in zip(*parts, strict=True):
        if len(gs) == 1:
            out.append(gs[0])
            continue
        found = [g for g in gs if g is not None]
        out.append(None if not found else torch.stack(found).sum(0) if len(found) > 1 else found[0])
    return out


def zeros_for_none(
    grads: list[torch.Tensor | None], shapes: list[tuple[torch.Size, torch.dtype]], device: Any
) -> list[torch.Tensor | None]:
    """``grads`` with zeros where one is None: for a stage wrapped in DDP, whose reducer
    waits for every parameter its forward reached from the outputs (a parameter behind an
    output no later stage used then gets zeros, as it did before Nones travelled)."""
    return [
        torch.zeros(shape, dtype=dtype, device=device) if g is None else g
        for g, (shape, dtype) in zip(grads, shapes, strict=True)
    ]


def with_grads(
    outs: list[Any], grads: list[torch.Tensor | None]
) -> tuple[list[Any], list[torch.Tensor]]:
    """The outputs (tensors or gradient edges) that have a gradient, and those gradients:
    an output whose gradient is None is left out of the backward, as autograd leaves
    out an output the loss does not use (with none at all, nothing runs)."""
    kept = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None]
    return [o for o, _ in kept], [g for _, g in kept]


def held_bytes(slots: dict[tuple[int, int], Slot]) -> int:
    """Bytes of the activations and gradients the slots reference (inputs, outputs,
    gradients waiting to be used or sent). Run after every action, so plain tensors,
    lists, tuples and dicts are walked directly (a pytree flatten costs more)."""
    total = 0
    for slot in slots.values():
        for tree in (slot.input, slot.output, slot.grad_parts, slot.grad_output, slot.grad_input):
            total += _nbytes(tree)
        if slot.captured is not None:
            total += _nbytes(slot.captured.grads)
    return total


def _nbytes(tree: Any) -> int:
    if tree is None:
        return 0
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    if type(tree) in (list, tuple):
        return sum(_nbytes(t) for t in tree)
    if type(tree) is dict:
        return sum(_nbytes(t) for t in tree.values())
    return sum(t.numel() * t.element_size() for t in tensor_leaves(tree))
