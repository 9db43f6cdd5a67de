"""The failure channel on real gloo groups: a raise and a SIGKILL reach every rank.

A frozen rank (SIGSTOP) is tested through the distributed backward
(``test_torch_dist_autograd.py``), which names it by its stopped heartbeat.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time
from typing import Any

from ranks import run_plain, run_ranks

HEARTBEAT = {"heartbeat_interval": 0.1, "heartbeat_timeout": 2.0}


def _recv_from(src: int, channel: Any, timeout: float, tag: int) -> tuple[str, str, float]:
    """Wait for a tensor from ``src`` that never comes; what was raised, and how fast."""
    import torch
    import torch.distributed as dist

    from xgrad.torch_backend.failure import transfer_failed, wait_work

    what = f"recv from rank {src}"
    start = time.monotonic()
    try:
        try:  # gloo refuses the post itself when the peer's death closed the connection
            work = dist.group.WORLD.recv([torch.zeros(2)], src, tag)
        except RuntimeError as exc:
            raise transfer_failed(channel, what, exc, src) from exc
        wait_work(work, channel, timeout=timeout, what=what, peer=src)
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


#: one rank as its own interpreter (its exit runs the atexit handlers, which a launcher's
#: forkserver child skips): ``n`` pipeline runtimes on the default group, a step on each,
#: the time printed, then the runtimes left alive as the interpreter exits.
_MANY_RUNTIMES = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from torch import nn
    import xgrad.pipeline as xp
    from xgrad.torch_backend.pipeline import PipelineRuntime

    rank, init, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    runtimes = []
    for _ in range(n):
        rt = PipelineRuntime(xp.one_f_one_b(2, 2), [nn.Linear(3, 3)], nn.MSELoss(), timeout=30)
        rt.step(x if rank == 0 else None, y if rank == 1 else None)
        runtimes.append(rt)
    print(time.time(), flush=True)
    """
)


def test_a_process_with_many_pipeline_runtimes_exits_promptly(tmp_path: Any) -> None:
    """Each runtime keeps an idle waiter thread; exit joined them one by one with half a
    second each, so 20 runtimes held each rank's exit for 10 s (1 s now, 0.4 s of it with
    none: torch's own teardown, about 30 ms a private group)."""
    ranks = run_plain(_MANY_RUNTIMES, 2, f"file://{tmp_path}/store", ["20"])
    exited = time.time()
    for code, out, err in ranks:
        assert code == 0, err[-3000:]
        took = exited - float(out.split()[-1])
        assert took < 5.0, took  # with room for a loaded machine
