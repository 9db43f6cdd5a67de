"""A chain of one small block per pipeline rank, and the whole model's gradients: what the
pipeline tests compare a rank's gradients with."""

from __future__ import annotations

from typing import Any


def chain_setup(
    rank: int, world: int, width: int, batch: int
) -> tuple[Any, Any, Any, list[list[Any]]]:
    """This rank's block, the batch (float64 ``x``, ``y``) and the whole model's gradients
    per block (mean-squared error over the chain of ``world`` Linear+Tanh blocks)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Linear(width, width), nn.Tanh()).double() for _ in range(world)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=g, dtype=torch.float64)
    y = torch.randn(batch, width, generator=g, dtype=torch.float64)
    out = x
    for part in parts:
        out = part(out)
    nn.functional.mse_loss(out, y).backward()
    want = [[p.grad.clone() for p in part.parameters()] for part in parts]
    for part in parts:
        part.zero_grad(set_to_none=True)
    return parts[rank], x, y, want


def worst_error(part: Any, want: list[Any]) -> float:
    """The largest relative error of ``part``'s gradients against ``want`` (its block's)."""
    return max(
        float((p.grad - w).norm() / w.norm()) for p, w in zip(part.parameters(), want, strict=True)
    )
