"""A DDP made while a peer is dead names it: the private group's creation used to fail
with c10d's bare "Wait timeout". Three gloo ranks; rank 2 is killed before the others
construct their DDP (timeout 3 s). The failure channel now starts before the group is
made, so its heartbeats tell who never came."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
from ranks import run_ranks


def _construct(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    dist.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        DistributedDataParallel(torch.nn.Linear(4, 2), timeout=3.0)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "origin": getattr(exc, "rank", None),
                "seconds": time.monotonic() - start}  # fmt: skip
    return {"error": None}


def test_a_peer_dead_before_the_ddp_is_made_is_named() -> None:
    results, codes = run_ranks(_construct, 3, timeout=60, frozen=[2])
    for rank in (0, 1):
        status, out = results[rank]
        assert status == "ok", out
        assert out["origin"] == 2, out
        assert out["error"].startswith(
            "RankUnresponsiveError: rank 2: never joined the DDP's process group"
        ), out
        assert out["seconds"] < 3.0 + 5.0, out
        assert codes[rank] == 0, codes
