"""A live rank late for the DDP's all-reduce is named, and the next steps work.

Three gloo ranks, a 2 s DDP timeout; rank 2 sleeps 4 s before a step's forward (alive:
its heartbeat goes on). Ranks 0 and 1 wait for it in the all-reduce; the error used to
name the rank that waited ("rank 0 in allreduce ...") with gloo's timeout text. Each
process now publishes with its heartbeat that it waits in a collective, and a rank that
times out there names the live rank that waits for nobody. Every rank raises in that
step, and the steps after it give the gradients of one process.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from ranks import run_ranks
from torch import nn

LATE = 2


def _steps(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(4, 2).double(), timeout=2.0)
    x = torch.arange(8 * 4, dtype=torch.float64).view(8, 4) / 10 + rank
    out: dict[str, Any] = {"errors": [], "grads": []}
    for step in range(3):
        if step == 1 and rank == LATE:
            time.sleep(4.0)
        ddp.zero_grad()
        try:
            ddp(x).sum().backward()
        except Exception as exc:
            out["errors"].append((step, f"{type(exc).__name__}: {exc}", getattr(exc, "rank", None)))
            continue
        out["grads"].append((step, ddp.module.weight.grad.tolist()))  # no tensor: fd passing
    return out


def test_a_late_rank_is_named_by_the_ranks_waiting_in_the_all_reduce() -> None:
    results, codes = run_ranks(_steps, 3, timeout=120)
    assert codes == {0: 0, 1: 0, 2: 0}, (codes, results)
    # One process: the mean of the three ranks' gradients (each is x's column sums).
    want = sum(torch.arange(32, dtype=torch.float64).view(8, 4) / 10 + r for r in range(3))
    want = want.sum(0).expand(2, 4) / 3
    for rank in range(3):
        status, out = results[rank]
        assert status == "ok", out
        assert [e[0] for e in out["errors"]] == [1], out["errors"]
        _, text, origin = out["errors"][0]
        assert origin == LATE, text
        assert f"rank {LATE}: did not answer within the timeout (rank " in text, text
        assert "waited for it in the collective)" in text, text
        assert [s for s, _ in out["grads"]] == [0, 2], out["grads"]
        for _, grad in out["grads"]:
            torch.testing.assert_close(
                torch.tensor(grad, dtype=torch.float64), want, rtol=1e-13, atol=1e-13
            )
