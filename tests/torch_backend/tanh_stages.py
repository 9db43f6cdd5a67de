"""Two-rank pipelines of tanh layers, for the pipeline runtime's tests: a schedule by name
(two chunks a rank where the schedule has chunks), its stages, and a batch."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import xgrad.pipeline as xp

M, WIDTH = 4, 3
#: schedules that place several stages on a rank (made with two chunks).
CHUNKED = frozenset({"interleaved_1f1b", "interleaved_zb", "looped_bfs", "zbv", "dualpipev"})


def schedule(name: str) -> xp.Schedule:
    """``name`` on two ranks, M microbatches."""
    return xp.make(name, 2, M, chunks=2) if name in CHUNKED else xp.make(name, 2, M)


def stages(n: int) -> list[nn.Module]:
    """``n`` stages of one tanh layer each, the same weights every call."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).double() for _ in range(n)]


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 2M rows and its targets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * M, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(2 * M, WIDTH, generator=g, dtype=torch.float64)


def runtime(name: str, rank: int, **kwargs: Any) -> tuple[list[nn.Module], tuple[int, ...], Any]:
    """``(every stage, this rank's stages, its runtime)`` for schedule ``name`` with an
    MSE loss (``kwargs`` go to the runtime)."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    made = schedule(name)
    every = stages(made.num_stages)
    mine = made.stages_of(rank)
    return every, mine, PipelineRuntime(made, [every[s] for s in mine], nn.MSELoss(), **kwargs)
