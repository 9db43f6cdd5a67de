"""A pipeline runtime's waiter threads end with the runtime: a loop that builds, steps and
drops a runtime per experiment keeps a bounded number of them (before, each dropped runtime
left an idle thread until the process exited), also when a step failed (the runtime then
replaced its waiters)."""

from __future__ import annotations

from typing import Any

import pytest
from chain import chain_setup, judged_step

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402

WIDTH, BATCH, M, RUNTIMES = 4, 4, 2, 10


def _waiter_threads() -> int:
    import threading

    return sum(t.name.startswith("xgrad-pipeline-") for t in threading.enumerate())


def _runtimes_in_a_loop(rank: int, world: int, fail: bool) -> list[Any]:
    """Per runtime, its steps' outcomes and the live waiter threads once it was dropped
    (with ``fail``, rank 1's forward pass raises in every other runtime's first step,
    which is followed by a good one)."""
    import gc
    import time

    from xgrad.torch_backend.pipeline import PipelineRuntime

    part, x, y, want = chain_setup(rank, world, WIDTH, BATCH)
    armed = [False]

    def pre_hook(module: Any, args: Any) -> None:
        if armed[0] and rank == 1:
            raise RuntimeError("boom")

    part.register_forward_pre_hook(pre_hook)
    rows: list[Any] = []
    for i in range(RUNTIMES):
        rt = PipelineRuntime(xp.gpipe(world, M), [part], nn.functional.mse_loss, timeout=20)
        words = []
        for armed[0] in [True, False] if fail and i % 2 else [False]:
            part.zero_grad(set_to_none=True)
            outcome, _ = judged_step(rt, part, want[rank], x, y)
            words.append(outcome if isinstance(outcome, str) else outcome[0])
        del rt
        gc.collect()
        deadline = time.monotonic() + 2.0  # a closed thread ends at once; allow a slow host
        while _waiter_threads() > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        rows.append((words, _waiter_threads()))
    return rows


@pytest.mark.parametrize("fail", [False, True], ids=["good", "failed"])
def test_dropped_runtimes_leave_no_waiter_threads(fail: bool) -> None:
    from ranks import run_ranks

    results, codes = run_ranks(_runtimes_in_a_loop, 2, (fail,), timeout=90)
    for rank in range(2):
        status, rows = results[rank]
        assert status == "ok", rows
        for i, (words, _) in enumerate(rows):
            failed = ["RankError: rank 1: 1F0 failed: RuntimeError: boom"]
            assert words == (failed if fail and i % 2 else []) + ["ok"], (rank, i, words)
        assert max(n for _, n in rows) <= 2, (rank, rows)
    assert codes == {0: 0, 1: 0}
