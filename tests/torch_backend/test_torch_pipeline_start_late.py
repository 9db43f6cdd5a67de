"""A rank still asleep from a failed step is named at the next step's start, not the waiters.

Three gloo ranks, 1F1B, a 2 s timeout. Rank 1 sleeps in step 2 (alive: its heartbeat goes
on) long past the timeout: the others fail that step, naming it, and begin step 3, whose
private groups are made afresh once every rank has started it. Rank 1 has not: the start
timed out, and each waiter named itself ("rank 0 in the start of the step ... timed out"),
as if the fault were its own. The ranks whose start is missing are the ones waited for,
so the timeout follows their heartbeats to the rank that waits for nobody.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from ranks import run_ranks
from torch import nn

import xgrad.pipeline as xp

WORLD, FROZEN, TIMEOUT, ASLEEP = 3, 1, 2.0, 7.0


def _asleep_in_step_two(rank: int, world: int) -> list[str]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    torch.manual_seed(rank)
    stage = nn.Linear(3, 3).double()
    rt = PipelineRuntime(
        xp.make("1f1b", world, 2), [stage], nn.functional.mse_loss, timeout=TIMEOUT
    )
    perform = type(rt)._perform
    armed = [False]

    def asleep(self: Any, action: Any, *args: Any, **kwargs: Any) -> Any:
        if armed[0]:
            armed[0] = False
            time.sleep(ASLEEP)  # past this step's timeout and the next step's start
        return perform(self, action, *args, **kwargs)

    type(rt)._perform = asleep  # type: ignore[method-assign]
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    out = []
    for k in range(3):
        armed[0] = rank == FROZEN and k == 1
        try:
            rt.step(x if rank == 0 else None, y if rank == world - 1 else None)
            out.append("ok")
        except Exception as exc:
            out.append(str(exc))
    return out


def test_a_rank_asleep_past_the_next_steps_start_is_named_by_every_rank() -> None:
    results, codes = run_ranks(_asleep_in_step_two, WORLD, timeout=90)
    assert set(codes.values()) == {0}, (codes, results)
    for rank in range(WORLD):
        word, out = results[rank]
        assert word == "ok", (rank, out)
        assert out[0] == "ok", (rank, out)
        named = f"rank {FROZEN}: did not answer within the timeout"
        assert out[1].startswith(named), (rank, out)
        # Step 3 failed at its start, waiting for the frozen rank, and names it there.
        assert out[2].startswith(named), (rank, out)
        assert "in the start of the step" in out[2], (rank, out)
