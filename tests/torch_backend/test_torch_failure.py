"""The failure channel on real gloo groups: a raise and a SIGKILL reach every rank.

A frozen rank (SIGSTOP) is tested through the distributed backward
(``test_torch_dist_autograd.py``), which names it by its stopped heartbeat.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from ranks import run_ranks

HEARTBEAT = {"heartbeat_interval": 0.1, "heartbeat_timeout": 2.0}


def _recv_from(src: int, channel: Any, timeout: float, tag: int) -> tuple[str, str, float]:
    """Wait for a tensor from ``src`` that never comes; what was raised, and how fast."""
    import torch
    import torch.distributed as dist

    from xgrad.torch_backend.failure import wait_work

    work = dist.group.WORLD.recv([torch.zeros(2)], src, tag)
    start = time.monotonic()
    try:
        wait_work(work, channel, timeout=timeout, what=f"recv from rank {src}", peer=src)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "none", "", time.monotonic() - start


def _raise_then_kill(rank: int, world: int) -> list[tuple[str, str, float]]:
    """Step 1: rank 1 fails and stays alive. Step 2: rank 1 is killed."""
    import torch.distributed as dist

    from xgrad.torch_backend.failure import abort_group, failure_channel

    out = []
    first = failure_channel(None, "step1", **HEARTBEAT)
    dist.barrier()
    if rank == 1:
        time.sleep(0.2)
        first.post("MulBackward0", "ValueError: boom")
        out.append(_recv_from(0, first, 30.0, tag=1))  # raises its own failure at once
    else:
        out.append(_recv_from(1, first, 30.0, tag=1))
    second = failure_channel(None, "step2", **HEARTBEAT)
    assert second.poll() is None, "a failure of step 1 leaked into step 2"
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    out.append(_recv_from(1, second, 30.0, tag=2))
    abort_group()
    return out


def test_raise_then_kill_reach_every_rank_and_processes_exit() -> None:
    results, codes = run_ranks(_raise_then_kill, 3, timeout=60)
    assert codes[1] == -signal.SIGKILL
    for r in (0, 2):
        status, value = results[r]
        assert status == "ok", value
        (kind1, msg1, t1), (kind2, msg2, t2) = value
        assert kind1 == "RankError"
        assert msg1 == "rank 1 in MulBackward0: ValueError: boom"
        assert t1 < 2.0
        assert kind2 == "RankUnresponsiveError"
        assert msg2.startswith("rank 1: stopped answering"), msg2
        assert t2 < 2.0 + 6.0  # heartbeat timeout, with room for a loaded machine
        assert codes[r] == 0
    # The failing rank itself raises its own failure in step 1.
    assert results.get(1) is None
