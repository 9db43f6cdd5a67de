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
    return parts[rank], x, y, whole_gradients(parts, x, y)


def whole_gradients(parts: list[Any], x: Any, y: Any) -> list[list[Any]]:
    """Each block's gradients when ``parts`` run as one chain on ``x`` (mean-squared error
    against ``y``), the blocks' ``.grad`` cleared again for the pipeline's run."""
    from torch import nn

    out = x
    for part in parts:
        out = part(out)
    nn.functional.mse_loss(out, y).backward()
    want = [[p.grad.clone() for p in part.parameters()] for part in parts]
    for part in parts:
        part.zero_grad(set_to_none=True)
    return want


def worst_error(part: Any, want: list[Any]) -> float:
    """The largest relative error of ``part``'s gradients against ``want`` (its block's)."""
    return max(
        float((p.grad - w).norm() / w.norm()) for p, w in zip(part.parameters(), want, strict=True)
    )


def judged_step(rt: Any, part: Any, want: list[Any], x: Any, y: Any) -> tuple[Any, float]:
    """One ``rt.step`` of a chain (``x`` on the first stage's rank, ``y`` on the last's) and its
    seconds: ``("ok", worst_error)`` against ``want`` (this rank's block's), or the error
    it raised as text."""
    import time

    place = rt.schedule.placement
    first, last = place[0] == rt.rank, place[-1] == rt.rank
    start = time.monotonic()
    try:
        rt.step(x if first else None, y if last else None)
        return ("ok", worst_error(part, want)), time.monotonic() - start
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
