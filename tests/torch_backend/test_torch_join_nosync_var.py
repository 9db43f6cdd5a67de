"""Under xgrad's ``join()``, a failure in a ``no_sync`` pass where the number of accumulation passes varies per step.

Gloo ranks, a ``try`` per step: step ``i`` runs ``ACC[i]`` ``no_sync`` passes, then a
synchronised one. The failing rank raises at its step's first accumulation pass and skips
the rest of that step; in its place it sends a count standing in for the step's
synchronised pass, which the other ranks still training meet with whatever pass of the
step they run next. Every rank that ran the step must raise it there, once, naming the
rank, within half the timeout; ranks that had joined raise it as they leave ``join()``;
a join context after it trains as PyTorch's DDP does.

Before:

* ``last_input``: a rank still training met the stand-in with a ``no_sync`` pass (the
  step had more accumulation there) and raised the failure there with the step's
  accumulation still open: its next step's first pass did not begin that step with its
  fresh group, and raised the failure again, step after step, while the rank that had
  joined waited for the fresh group: every rank hung past the timeout.
* ``next_unaccumulated``: the failing rank's next step accumulates nothing: its first
  pass is synchronised, which was taken for the failed step's own (as with a ``try``
  per micro-batch) and raised the failure a second time, the step lost; a rank still
  training met the stand-in with a ``no_sync`` pass of the failed step, which says the
  synchronised pass is a later step's.
* ``next_unaccumulated`` at three ranks, in about one run in three (in every run where the
  joined rank is :data:`LATE` after the pass it shadows): the rank that had joined saw
  the failure posted before its count, and began the next step ahead, waiting
  for the others' marks, where the failing rank's stand-in (which reads its sum, the
  failing rank's next pass being synchronised) waited for that count: each waited for the
  other to the timeout, and the ranks then went on with different collectives (every rank
  hung to the launcher's timeout). Now the joined rank counts first, meeting the stand-in.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
from join_cases import (
    check_after_as_pytorch,
    nosync_step,
    run_steps,
    trained_after,
)
from ranks import armed_linear, every_rank_ok

TIMEOUT = 3.0
#: how long a joined rank takes after each pass it shadows (a busy machine): it sees a
#: ``no_sync`` pass's failure posted before its next count (the order that hung).
LATE = 0.05

#: name -> world -> (batches of rank 0, 1, ...; the failing rank; the step it fails at;
#: the number of no_sync passes of each step)
CASES: dict[str, dict[int, tuple[list[int], int, int, tuple[int, ...]]]] = {
    # the failing rank's last input; the others accumulate twice in that step
    "last_input": {
        2: ([2, 4], 0, 1, (1, 2, 1, 2)),
        3: ([2, 3, 4], 0, 1, (1, 2, 1, 2)),
    },
    # the failing rank's step after it has no no_sync pass (only the failing rank and
    # one other still train in the failed step)
    "next_unaccumulated": {
        2: ([3, 4], 1, 2, (0, 1, 2, 0)),
        3: ([1, 3, 4], 2, 2, (0, 1, 2, 0)),
    },
}


def _slow_joined_ranks() -> None:
    """Every joined rank of this process sleeps :data:`LATE` after each pass it shadows."""
    from xgrad.torch_backend.join_hook import DDPJoinHook

    shadow = DDPJoinHook.main_hook

    def main_hook(self: DDPJoinHook) -> None:
        shadow(self)
        time.sleep(LATE)

    DDPJoinHook.main_hook = main_hook  # type: ignore[method-assign]


def _run(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    _slow_joined_ranks()
    model, armed = armed_linear()
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    x = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    out: dict[str, Any] = {}
    for name, per_world in CASES.items():
        batches, failing, at, acc = per_world[world]

        def step(i: int, failing: int = failing, at: int = at, acc: Any = acc) -> str:
            model.zero_grad()
            return nosync_step(ddp, x, acc[i], rank == failing and i == at, armed)

        out[name] = run_steps(ddp.join, batches[rank], step)
    # A join context after them, against PyTorch's DDP from the same parameters.
    reference = copy.deepcopy(model)
    theirs = TorchDDP(reference)
    sides = [("xgrad", [ddp], [model], ddp.join), ("torch", [theirs], [reference], theirs.join)]
    out["after"] = trained_after(sides, x, rank, lambda i: i % 2, lambda y: y.pow(2).mean())
    return out


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    # a hang is a failure of the launcher (its timeout), not a stuck suite
    return request.param, every_rank_ok(_run, request.param, timeout=60)


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_the_step_once_at_once_naming_the_rank(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    batches, failing, at, _ = CASES[name][world]
    boom = f"rank {failing} in forward: ValueError: boom"
    for rank, result in results.items():
        run = result[name]
        assert run["seconds"] < TIMEOUT / 2, (name, rank, run)  # never a timeout
        if at < batches[rank]:  # ran the step: raised there, once; left cleanly
            errors = [s for s in run["steps"] if s != "ok"]
            assert len(errors) == 1 and boom in errors[0], (name, rank, run)
            assert run["steps"].index(errors[0]) == at, (name, rank, run)
            assert len(run["steps"]) == batches[rank], (name, rank, run)
            assert run["left"] == "left", (name, rank, run)
        else:  # had joined: raises it as it leaves join()
            assert "ok" in run["steps"] and len(set(run["steps"])) == 1, (name, rank, run)
            assert run["left"].startswith("RankError") and boom in run["left"], (name, rank, run)


def test_a_join_context_after_them_trains_as_pytorch(outcome: tuple[int, dict[int, Any]]) -> None:
    check_after_as_pytorch(outcome[1], rtol=1e-6)
