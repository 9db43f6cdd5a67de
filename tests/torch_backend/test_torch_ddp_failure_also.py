"""Two ranks of a DDP fail in the same step: a rank that raises a peer's failure names,
after the step's first one, every other failure in the channel by then (a line "also
rank R: ..." each), as the pipeline's errors do. Before, the third rank named the first
failure alone. A failing rank whose failure was not the first names its own the same way
(before, only the exception's cause said it); the first failing rank's error is the first
failure alone, and both are instances of their own ValueError."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import pytest
from ranks import run_ranks

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
SHARD = 4


def _posted(ddp: Any, n: int) -> None:
    """Wait until the step's ``n``-th failure is in the store (read there: the DDP's
    channel would take the first for its own)."""
    channel = ddp._watch.channel
    deadline = time.monotonic() + 20.0
    while not channel.store.check([f"{channel.prefix}/failure/{n}"]):
        assert time.monotonic() < deadline, f"failure {n} never posted"
        time.sleep(0.005)


def _two_fail(rank: int, world: int, where: str) -> list[str]:
    """Three steps; in the second, rank 0 raises ("zero") in ``where`` (the forward pass
    or the comm hook), rank 1 raises ("one") there once rank 0's failure is posted, and
    rank 2 goes on once both are, so it finds them in its reduction. Per step: the error,
    or "ok"."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update(FAST)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    ddp = DistributedDataParallel(model, timeout=20.0)
    armed = [False]

    def fault() -> None:
        if armed[0]:
            armed[0] = False
            if rank:
                _posted(ddp, rank)
            if rank < 2:
                raise ValueError(("zero", "one")[rank])

    def pre_hook(module: Any, inputs: Any) -> None:
        if where == "forward":
            fault()

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if where == "hook":
            fault()
        return allreduce_hook(state, bucket)

    model.register_forward_pre_hook(pre_hook)
    ddp.register_comm_hook(None, hook)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(SHARD, 5, generator=g), torch.randn(SHARD, 2, generator=g)
    out: list[str] = []
    warnings.simplefilter("ignore", RuntimeWarning)  # the next step's, on what was dropped
    for step in range(3):
        armed[0] = step == 1
        ddp.zero_grad()
        try:
            ((ddp(x) - y) ** 2).mean().backward()
            out.append("ok")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


@pytest.mark.parametrize("where", ["forward", "hook"])
def test_a_rank_names_every_rank_whose_failure_reached_it(where: str) -> None:
    results, codes = run_ranks(_two_fail, 3, (where,), timeout=90)
    place = "forward" if where == "forward" else "comm hook, bucket 0"
    zero = f"rank 0 in {place}: ValueError: zero"
    one = f"rank 1 in {place}: ValueError: one"
    for rank in range(3):
        status, out = results[rank]
        assert status == "ok", (rank, out)
        assert out[0] == "ok" and out[2] == "ok", (rank, out)
    assert results[2][1][1] == f"RankError: {zero}\nalso {one}", results
    # The first failing rank: its own failure alone; the second names its own after it.
    assert results[0][1][1] == f"RankError[ValueError]: {zero}", results
    assert results[1][1][1] == f"RankError[ValueError]: {zero}\nalso {one}", results
    assert codes == {0: 0, 1: 0, 2: 0}
