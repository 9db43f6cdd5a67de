"""The rank that aborted (or destroyed) a DDP's group, using that DDP again, is told so.

Two gloo ranks, a DDP on a group of both; after a good step rank 0 calls ``abort_group``
on that group (as an error handler might). Its next step, a ``no_sync`` pass and an
evaluation that syncs buffers on the old DDP raised c10d's bare ``KeyError`` (the group's
store, looked up for the step's heartbeat); each now raises a ``RankError`` saying that
rank 0 aborted the group and that a new group and a new DDP are needed, at once. Its peer's
step names the abort as before. A new group and a new DDP then train: the gradients are
the ranks' mean. The same after ``abort_group()`` of the default group on both ranks (a
new default group made on a new store), and after ``destroy_process_group(group)``.
PyTorch 2.13's DDP on the aborted group waits on the peer in the next forward pass's
buffer broadcast until the peer's process exits, then raises gloo's "Connection closed
by peer".
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from ranks import run_ranks

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
OWN = (
    "RankError: rank {rank}: {how} the process group ({call}) that this "
    "DistributedDataParallel reduces over: it takes no part in the group's collectives "
    "again; make a new group, and a new DistributedDataParallel on it, to go on"
)


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))  # a buffer: eval syncs it


def _after_abort(rank: int, world: int, how: str, path: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.failure import abort_group

    os.environ.update(FAST)
    group = None if how == "world" else dist.new_group([0, 1])
    ddp = DistributedDataParallel(_model(), process_group=group, timeout=3.0)
    ddp(torch.randn(5, 4)).sum().backward()
    log: dict[str, Any] = {}

    def record(name: str, body: Any) -> None:
        start = time.monotonic()
        try:
            body()
            log[name] = "ok"
        except Exception as exc:
            log[name] = f"{type(exc).__name__}: {exc}"
        log[name + " s"] = time.monotonic() - start

    def step() -> None:
        ddp(torch.randn(5, 4)).sum().backward()

    def accumulate() -> None:
        with ddp.no_sync():
            step()

    def evaluate() -> None:
        ddp.eval()
        with torch.no_grad():
            ddp(torch.randn(5, 4))
        ddp.train()

    if how == "world" or rank == 0 or how == "destroyed":
        if how == "destroyed":
            dist.destroy_process_group(group)
        else:
            abort_group(group)
        for name, body in (("step", step), ("no_sync", accumulate), ("eval", evaluate)):
            record(name, body)
    else:
        time.sleep(0.5)  # rank 0's heartbeat has told the abort
        record("step", step)
    if how == "world":  # every group is gone: a new default group, on a new store
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    model = _model()
    new = DistributedDataParallel(model, process_group=dist.new_group([0, 1]), timeout=3.0)
    new(_batch(rank)).pow(2).mean().backward()
    log["grad"] = model[0].weight.grad
    return log


@pytest.mark.parametrize("how", ["group", "world", "destroyed"])
def test_old_ddp_names_the_abort_and_a_new_one_trains(how: str, tmp_path: Any) -> None:
    results, codes = run_ranks(_after_abort, 2, (how, str(tmp_path / "store")), timeout=60)
    assert codes == {0: 0, 1: 0}, results
    call = "destroy_process_group" if how == "destroyed" else "abort_group"
    verb = "destroyed" if how == "destroyed" else "aborted"
    for rank in (0, 1):
        log = results[rank][1]
        if rank == 0 or how != "group":
            for name in ("step", "no_sync", "eval"):
                assert log[name] == OWN.format(rank=rank, how=verb, call=call), log
                assert log[name + " s"] < 1.0, log
        else:
            assert log["step"].startswith(
                "RankUnresponsiveError: rank 0: aborted the process group: it takes no "
                "part in the group's collectives again; make a new group to go on"
            ), log
        # The mean of both ranks' gradients: the new DDP trains.
        torch.testing.assert_close(log["grad"], _mean_grad(), rtol=1e-5, atol=1e-6)


def _batch(rank: int) -> Any:
    import torch

    return torch.randn(5, 4, generator=torch.Generator().manual_seed(10 + rank))


def _mean_grad() -> Any:
    """The first layer's gradient, the mean of both ranks' batches', on one process."""
    grads = []
    for rank in (0, 1):
        model = _model()
        model(_batch(rank)).pow(2).mean().backward()
        grads.append(model[0].weight.grad)
    return (grads[0] + grads[1]) / 2
