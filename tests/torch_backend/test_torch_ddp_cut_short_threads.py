"""Two DDPs in two threads of a rank, both cut short: each one's peers read its own text.

Two gloo ranks; each runs two threads, thread ``k`` training its own DDP on its own
group (``k`` = 0, 1). At step 1 rank 1's activation hooks raise ``ValueError("boom k")``
in both threads' backward passes at once: thread 1's pass begins inside thread 0's
backward call, and thread 0 raises first. ``ddp_cut_short.NotingEngine`` matched a pass
to the call that cut it short by when the pass began, so thread 0's exception was noted
on both DDPs, the first noted text stayed, and rank 0's thread 1 read "boom 0". Now each
pass is noted by the call of its own thread: thread ``k``'s peer reads
"rank 1 in backward: ValueError: boom k", and step 2 is right in both threads. The same
with the threads' passes under ``no_sync`` (the step they accumulated for is given up).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
from ranks import run_ranks

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}


def _two_threads(rank: int, world: int, nosync: bool) -> dict[int, list[str]]:
    """Three steps in each of two threads (a ``no_sync`` pass first in each step with
    ``nosync``); at step 1 rank 1's hook raises in both threads' first backward pass."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update(FAST)
    groups = [dist.new_group([0, 1]) for _ in range(2)]
    began = threading.Event()  # thread 0's failing backward call is under way
    both = threading.Barrier(2, timeout=20)  # both passes begun, neither raised yet
    out: dict[int, list[str]] = {0: [], 1: []}

    def run(k: int) -> None:
        torch.manual_seed(k)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
        ddp = DistributedDataParallel(model, process_group=groups[k], timeout=20)
        armed = [False]

        def fault(grad: Any) -> Any:  # on the first layer's output: after the pass began
            if armed[0]:
                armed[0] = False
                both.wait()
                if k == 1:
                    threading.Event().wait(0.3)  # thread 0 raises first
                raise ValueError(f"boom {k}")
            return grad

        def started(grad: Any) -> Any:  # on the output: the first node of the pass
            if armed[0] and k == 0:
                began.set()
            return grad

        def on_output(module: Any, inputs: Any, output: Any) -> None:
            output.register_hook(fault)

        model[0].register_forward_hook(on_output)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * k + rank))

        def backward() -> None:
            y = ddp(x)
            y.register_hook(started)
            if armed[0] and k == 1:
                assert began.wait(20)  # thread 1's call begins within thread 0's
            y.pow(2).mean().backward()

        for step in range(3):
            model.zero_grad()
            armed[0] = rank == 1 and step == 1
            try:
                if nosync:
                    with ddp.no_sync():
                        backward()
                backward()
                out[k].append("ok")
            except Exception as exc:
                out[k].append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return out


@pytest.mark.parametrize("nosync", [False, True], ids=["synchronised", "no_sync"])
def test_each_threads_peers_read_its_own_exception(nosync: bool) -> None:
    results, codes = run_ranks(_two_threads, 2, (nosync,), timeout=120)
    assert codes == {0: 0, 1: 0}, results
    for k in (0, 1):
        assert results[1][1][k] == ["ok", f"ValueError: boom {k}", "ok"], results
        # the step given up under no_sync is raised in its synchronised pass
        assert results[0][1][k] == [
            "ok",
            f"RankError: rank 1 in backward: ValueError: boom {k}",
            "ok",
        ], results
