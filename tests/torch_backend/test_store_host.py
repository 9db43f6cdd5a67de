"""Rank 0 hosts the group's TCPStore, then freezes or dies: the others name it and exit.

``init_process_group`` without ``torchrun`` starts the store in rank 0's process. With
rank 0 frozen (SIGSTOP) every store call of the others used to block for ever (c10d's
client bounds only some calls), so the reads that were to name the frozen rank hung
every peer past any timeout; with rank 0 killed they raised c10d's bare "Broken pipe".
Now each store call is bounded by the heartbeat timeout (:mod:`xgrad.store_guard`).
Real gloo ranks on a real TCPStore (every other test uses a file store, which no rank hosts).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
from torch import nn

from xgrad.torch_backend.gather import OK, gather_ranks

#: the heartbeat timeout, which also bounds each store call.
BEAT = "2"
#: the pipeline's and the DDP's own wait bound, longer: the store's bound must come first.
TIMEOUT = 8.0


def _stop_rank_0(rank: int, how: str) -> None:
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def _attempt(step: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        step()
    except Exception as exc:
        return {
            "error": f"{type(exc).__name__}: {exc}",
            "origin": getattr(exc, "rank", None),
            "seconds": time.monotonic() - start,
        }
    return {"error": None, "seconds": time.monotonic() - start}


def _ddp(rank: int, world: int, how: str) -> dict[str, Any]:
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(4, 2).double(), timeout=TIMEOUT)
    x = torch.randn(8, 4, dtype=torch.float64) + rank

    def step() -> None:
        ddp(x).sum().backward()

    step()  # a good step first: the guarded store answers as the store does
    _stop_rank_0(rank, how)
    return {"step": _attempt(step), "again": _attempt(step)}


def _dist_autograd(rank: int, world: int, how: str) -> dict[str, Any]:
    from xgrad.torch_backend import dist_autograd as da

    w = torch.arange(3.0, dtype=torch.float64, requires_grad=True)

    def step() -> None:
        with da.context(timeout=TIMEOUT) as cid:
            if rank == world - 1:
                da.backward(cid, [(da.recv(world - 2) * w).sum()])
            elif rank == world - 2:
                da.send(w * 2, world - 1)
                da.backward(cid, [])
            else:
                da.backward(cid, [])
            grads = da.get_gradients(cid)
        if rank >= world - 2:  # loss = sum(2 w1 * w2), with w1 = w2 = w: both get 2 w
            assert torch.equal(grads[w], 2 * w.detach()), grads

    step()
    _stop_rank_0(rank, how)
    return {"step": _attempt(step)}


def _pipeline(rank: int, world: int, how: str) -> dict[str, Any]:
    import xgrad.pipeline as xp
    from xgrad.torch_backend.pipeline import PipelineRuntime

    torch.manual_seed(rank)
    rt = PipelineRuntime(
        xp.make("1f1b", world, 4),
        [nn.Linear(3, 3).double()],
        nn.functional.mse_loss,
        timeout=TIMEOUT,
    )
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    last = rank == world - 1

    def step() -> None:
        rt.step(x if rank == 0 else None, y if last else None)

    step()
    _stop_rank_0(rank, how)
    return {"step": _attempt(step)}


CASES = {"ddp": _ddp, "dist_autograd": _dist_autograd, "pipeline": _pipeline}


@pytest.mark.parametrize(
    ("system", "how", "world", "bound"),
    [
        ("ddp", "freeze", 3, 6.0),  # the heartbeat timeout, 2 s, names it
        ("dist_autograd", "freeze", 3, 6.0),
        # The pipeline's receive blocks its thread until its own timeout; then the store.
        ("pipeline", "kill", 2, TIMEOUT + 4.0),
    ],
)
def test_a_frozen_or_dead_store_host_is_named_and_the_others_exit(
    system: str, how: str, world: int, bound: float
) -> None:
    results, codes = gather_ranks(
        CASES[system],
        world,
        (how,),
        limit=60,
        wait_for=range(1, world),
        env={"XGRAD_HEARTBEAT_TIMEOUT": BEAT},
        store="tcp",
    )
    for rank in range(1, world):
        status, value = results[rank]
        assert status == OK, value
        step = value["step"]
        assert step["origin"] == 0, step
        kind, _, text = step["error"].partition(": ")
        assert kind.endswith("UnresponsiveError"), step  # DistBackwardUnresponsiveError too
        text = text.removeprefix("Error on ")  # the distributed backward's wording
        assert text.startswith("rank 0: stopped answering: the store it hosts (TCPStore "), step
        assert ("did not answer store." if how == "freeze" else "is gone: store.") in step[
            "error"
        ], step
        assert step["seconds"] < bound, step
        if "again" in value:  # the next step: the same named error at once, not a wait
            assert value["again"]["origin"] == 0 and value["again"]["seconds"] < 1.0, value
        assert codes[rank] == 0, codes  # the survivors exit by themselves
