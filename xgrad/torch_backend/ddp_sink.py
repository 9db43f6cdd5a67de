"""A forward's outputs through one autograd node, so a loss may leave some of them out.

With ``find_unused_parameters`` DDP decides at the end of the forward pass which
parameters the backward pass will reach: those reachable from the outputs. A model that
returns several outputs (a namedtuple or dict of logits and auxiliary heads) and a loss
that uses only some of them would leave the others' parameters waiting for a gradient
that never comes, and the buckets holding them would never be reduced. PyTorch's DDP
routes the outputs through one node (``_DDPSink``) whose backward passes ``None`` for the
outputs the loss left out: autograd still runs every node behind the sink, so each of
those parameters' hooks fires, with ``.grad`` still ``None``, and the reducer counts it
as unused on this rank (PyTorch's local used map counts defined gradients only). This
module does the same. The outputs are flattened as PyTorch flattens them
(``torch.utils._pytree``: tuples, lists, dicts, namedtuples; a dataclass is one leaf, so
its tensors are not routed, as in PyTorch), and are cloned, as PyTorch does by default,
so the caller may still change them in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["route_outputs"]


class _Sink(torch.autograd.Function):
    """Identity on its inputs; an output the loss did not use gets ``None``, not zeros."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return grads


def route_outputs(output: Any) -> Any:
    """``output`` with its tensors that have a ``grad_fn`` routed through one sink node.

    Only where it matters: with fewer than two such tensors the backward pass that
    reaches one reaches everything behind it, so ``output`` comes back unchanged.
    """
    leaves, spec = tree_flatten(output)
    where = [
        i
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None
    ]
    if len(where) < 2:
        return output
    routed = _Sink.apply(*(leaves[i] for i in where))
    for i, tensor in zip(where, routed, strict=True):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)
