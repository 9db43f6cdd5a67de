"""A torch ``grad_fn`` node as a node function of xgrad's engine.

:func:`.dist_graph.build_rank_graph` turns one rank's ``grad_fn`` graph into xgrad data;
each function node of it runs through :func:`node_caller`, which calls the torch node
itself and does between nodes what PyTorch's engine does (a broadcast input's gradient
summed back to its shape and cast to its dtype, a Python Function's results matched to
its tensor inputs, zeros where nothing arrived, the node's hooks around it). Kept apart
from the walk because it is the other half: the walk decides which nodes and edges there
are, this decides what running one of them means. :func:`recorded` notes which nodes a
gradient reached, and :func:`root_function` seeds the roots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from xgrad.engine import NodeFunction
from xgrad.torch_backend.dist_hooks import call_node_hooks
from xgrad.torch_backend.dist_split import fit

__all__ = ["node_caller", "recorded", "root_function"]


def node_caller(
    fn: Any,
    keep: list[int],
    wants: list[Any],
    hooks: tuple[Any, Any] | None = None,
    materialize: bool = True,
) -> NodeFunction:
    """Run torch node ``fn`` and return the gradients of the edges kept in the graph.

    ``wants`` is the input metadata of each kept edge's destination: as PyTorch's engine
    does between nodes, a gradient of a broadcast input is summed back to the input's
    shape, and cast to its dtype. A Python Function's results are matched to its tensor
    inputs as PyTorch's engine matches them (results for non-tensor inputs are dropped).
    The node's pre- and post-hooks (``hooks``, its hook dicts as :mod:`.dist_hooks` found
    them) run around it. Without ``materialize`` (it called ``set_materialize_grads(False)``)
    a Python Function's backward gets None where no gradient came.
    """
    call = fn.apply if isinstance(fn, BackwardCFunction) else fn
    meta = getattr(fn, "_input_metadata", None) if isinstance(fn, BackwardCFunction) else None
    # The node takes one gradient per output of its forward; the graph numbers only the
    # slots some edge leads to, so a node whose last outputs are unused (``a, _ =
    # x.chunk(2)``) gets fewer. PyTorch's engine passes undefined gradients there.
    slots = len(fn._input_metadata)
    # A Python Function's backward returns one gradient per input of its forward, tensors
    # or not (``checkpoint(f, x)`` passes ``f`` first), while ``next_functions`` lists its
    # tensor inputs only. The edges that lead somewhere are those of the inputs that need
    # a gradient, in the same order: map each to its place in the backward's result.
    at = list(range(len(fn.next_functions)))
    if meta is not None:
        needs = [j for j, need in enumerate(fn.needs_input_grad) if need]
        live = [i for i, (child, _) in enumerate(fn.next_functions) if child is not None]
        if len(needs) != len(live):
            raise ValueError(
                f"{type(fn).__name__}: {len(needs)} inputs need a gradient but "
                f"{len(live)} edges lead to a node; cannot place its backward's results"
            )
        for i, j in zip(live, needs, strict=True):
            at[i] = j

    def node(inputs: list[Any]) -> tuple[Any, ...]:
        if meta is not None and materialize:
            # A Python Function's backward expects zeros, not None, where nothing arrived.
            inputs = [
                torch.zeros(m.shape, dtype=m.dtype, device=m.device) if g is None else g
                for g, m in zip(inputs, meta, strict=True)
            ]
        out = call(*inputs)
        return out if isinstance(out, tuple) else (out,)

    linked = [child is not None for child, _ in fn.next_functions]
    everywhere = list(range(len(at)))

    def hooked(inputs: list[Any]) -> tuple[Any, ...]:
        """The node's results between its hooks, one per next edge (None: to no node)."""
        out = node(inputs)
        return tuple(out[j] if to else None for j, to in zip(at, linked, strict=True))

    def run(inputs: list[Any]) -> list[Any]:
        if len(inputs) < slots:
            inputs = [*inputs, *[None] * (slots - len(inputs))]
        if hooks is None:
            out, place = node(inputs), at
        else:
            out, place = call_node_hooks(*hooks, hooked, inputs), everywhere
        grads = []
        for i, want in zip(keep, wants, strict=True):
            g = out[place[i]]
            grads.append(None if g is None else fit(g, want))
        return grads

    return run


def recorded(run: NodeFunction, u: int, ran: list[int]) -> NodeFunction:
    """``run``, noting node ``u`` in ``ran`` when a gradient reaches it (the engine calls a
    node whose inputs are all None too: its part of the graph did not run)."""

    def call(inputs: list[Any]) -> Sequence[Any]:
        for g in inputs:
            if g is not None:
                ran.append(u)
                break
        return run(inputs)

    return call


def root_function(roots: Sequence[torch.Tensor]) -> NodeFunction:
    def run(inputs: list[Any]) -> list[Any]:
        return [torch.ones_like(r) for r in roots]

    return run
