"""A rank late for the DDP's reduction is named in two cases the plain late test misses.

Two gloo ranks, a 2 s DDP timeout; rank 1 sleeps (alive: its heartbeat goes on) between
its forward and its backward pass of step 1.

``find_unused_parameters=True``: the reducer waits for the used-parameter map before
the buckets. Gloo runs the two all-reduces in order, so the bucket's timed out first and
closed the connection, and the map's wait failed with "Application timeout caused pair
closure", read as a group lost in an earlier step: both ranks raised
"rank 0 in allreduce of 9 elements" (the waiting rank, as its own failure).

A rank that wakes within the 2 s the waiting rank reads the heartbeats for after its
timeout (in case a peer stopped just then): it had come by the time the waiting rank
looked for a rank waiting for nobody, and was taken for on time; again both ranks named
rank 0, whose comm hook "failed". The waiting rank now notes who waited for nobody when
its wait ran out, before that read.

In both, every rank now names rank 1 as late, and the next step gives the mean of both
ranks' gradients.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from ranks import run_ranks

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
TIMEOUT = 2.0
LATE = 1


class _Spared(torch.nn.Module):
    """``body`` and a layer it never uses: the reducer sums a used-parameter map."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body
        self.spare = torch.nn.Linear(4, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def _steps(rank: int, world: int, case: str, sleep: float) -> dict[str, Any]:
    os.environ.update(FAST)
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from xgrad.torch_backend import DistributedDataParallel

    body = _model()
    unused = case == "find_unused"
    model = _Spared(body) if unused else body
    ddp = DistributedDataParallel(model, find_unused_parameters=unused, timeout=TIMEOUT)
    if not unused:
        ddp.register_comm_hook(None, allreduce_hook)
    out: dict[str, Any] = {"errors": [], "grads": []}
    for step in range(3):
        ddp.zero_grad()
        x = torch.arange(12, dtype=torch.float64).view(3, 4) / 10 + rank + step
        try:
            loss = ddp(x).square().sum()
            if step == 1 and rank == LATE:
                time.sleep(sleep)
            loss.backward()
        except Exception as exc:
            out["errors"].append((step, f"{type(exc).__name__}: {exc}", getattr(exc, "rank", None)))
            continue
        out["grads"].append((step, [p.grad.tolist() for p in body.parameters()]))
    return out


def _want(step: int, world: int) -> list[Any]:
    """The mean of the ranks' gradients of ``step``, on one process."""
    import torch

    model = _model()
    for rank in range(world):
        x = torch.arange(12, dtype=torch.float64).view(3, 4) / 10 + rank + step
        (model(x).square().sum() / world).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize(
    ("case", "sleep"),
    # wakes long after the timeout; wakes while the waiting rank reads the heartbeats
    [("find_unused", 2 * TIMEOUT + 1.0), ("comm_hook", TIMEOUT + 1.0)],
)
def test_a_rank_late_for_the_reduction_is_named_on_every_rank(case: str, sleep: float) -> None:
    start = time.monotonic()
    results, codes = run_ranks(_steps, 2, (case, sleep), timeout=120)
    assert codes == {0: 0, 1: 0}, (codes, results)
    for rank in range(2):
        status, out = results[rank]
        assert status == "ok", out
        assert [e[0] for e in out["errors"]] == [1], out["errors"]
        _, text, origin = out["errors"][0]
        assert origin == LATE, (rank, text)
        assert text.startswith(f"RankUnresponsiveError: rank {LATE}: did not answer within"), text
        assert [s for s, _ in out["grads"]] == [0, 2], out["grads"]
        for step, grads in out["grads"]:
            for got, want in zip(grads, _want(step, 2), strict=True):
                torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want)
    assert time.monotonic() - start < 60
