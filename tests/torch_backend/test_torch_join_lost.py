"""A rank lost while another has joined is named there, not left as gloo's error.

Two gloo ranks under ``ddp.join()``: rank 0 runs out of inputs and joins; rank 1 is
killed (SIGKILL) at its next step. Rank 0, counting the ranks still training, got
gloo's "Connection closed by peer" naming nobody; it now raises the DDP's
``RankUnresponsiveError`` naming rank 1 (its heartbeat stopped), within seconds.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from ranks import run_ranks


def _joined_then_lost(rank: int, world: int) -> str:
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 2), timeout=10.0)
    start = time.monotonic()
    try:
        with ddp.join():
            for step in range(1 if rank == 0 else 3):
                if rank == 1 and step == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                ddp.zero_grad()
                ddp(torch.randn(3, 4)).pow(2).mean().backward()
    except Exception as exc:
        return f"{time.monotonic() - start:.1f} {type(exc).__name__}: {exc}"
    return "no error"


def test_a_rank_killed_while_another_has_joined_is_named() -> None:
    results, codes = run_ranks(_joined_then_lost, 2, timeout=60)
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, (codes, results)
    seconds, text = results[0][1].split(" ", 1)
    assert text.startswith("RankUnresponsiveError: rank 1: stopped answering"), text
    assert "join" in text and float(seconds) < 9.0, text
