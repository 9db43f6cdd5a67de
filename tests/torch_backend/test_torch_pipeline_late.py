"""A rank late for a step is named, not the live rank waiting for it in between.

Four gloo ranks, 1F1B, a 2 s timeout; rank 2 sleeps through most of a step (alive: its
heartbeat goes on). Rank 0 waits for rank 1's gradient, and rank 1 for rank 2: rank 0,
ahead in its schedule, times out first, and its failure used to name rank 1. The heartbeats publish whom each rank waits for, and a rank
that times out on a live peer follows those waits to the rank that waits for nobody.
"""

from __future__ import annotations

import time

import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn


def _late(rank: int, world: int, late: int) -> str:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    torch.manual_seed(rank)
    stage = nn.Linear(3, 3).double()
    rt = PipelineRuntime(xp.make("1f1b", world, 4), [stage], nn.functional.mse_loss, timeout=2)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    last = rank == world - 1
    rt.step(x if rank == 0 else None, y if last else None)
    if rank == late:
        time.sleep(4)
    try:
        rt.step(x if rank == 0 else None, y if last else None)
    except Exception as exc:
        return str(exc)
    return "no error"


def test_the_late_rank_is_named_not_the_one_waiting_for_it() -> None:
    for late in (2,):
        for rank, text in enumerate(spawn(_late, 4, args=(late,), timeout=90)):
            assert text.startswith(f"rank {late}: did not answer within the timeout"), (
                late,
                rank,
                text,
            )
