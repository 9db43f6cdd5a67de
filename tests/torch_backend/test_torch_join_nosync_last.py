"""Under xgrad's ``join()``, a step that fails in a ``no_sync`` pass of the failing rank's last input.

Gloo ranks, a ``try`` per step (a ``no_sync`` pass, then a synchronised one). The failing
rank raises at its accumulation pass, skips the step's synchronised pass and, having no
input left, joins. The ranks still training run that synchronised pass: they must raise
the step's failure there, naming the rank, at once; ranks that had joined raise it as
they leave ``join()``; a join context after it trains as PyTorch's DDP does.

Before, the failing rank's first count as a joined rank began the next step through the
path of a forward pass, which raised the given-up failure again (out of ``join()``)
before it sent the count standing in for the skipped synchronised pass: the other ranks
hung past the timeout ("last_rank", 3 ranks), waited it out naming no one
("last_rank", 2 ranks), or had their next steps fail with the group ("first_rank").
"""

from __future__ import annotations

import copy
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

#: name -> (batches of rank 0, 1, ...; the failing rank; the step it fails at)
CASES = {
    "last_rank": ([1, 3, 3], 2, 2),  # ranks 1 and 2 in the step, rank 0 joined
    "only_rank": ([1, 1, 3], 2, 2),  # the failing rank is the only one still training
    "first_rank": ([2, 3, 3], 0, 1),  # the others train on after it
}


def _case(name: str, world: int) -> tuple[list[int], int, int]:
    batches, failing, at = CASES[name]
    if world == 2:  # rank 2's part goes to rank 1
        failing, batches = min(failing, 1), [batches[0], batches[2]]
    return batches, failing, at


def _run(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    model, armed = armed_linear()
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    x = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    out: dict[str, Any] = {}
    for name in CASES:
        batches, failing, at = _case(name, world)

        def step(i: int, failing: int = failing, at: int = at) -> str:
            model.zero_grad()
            return nosync_step(ddp, x, 1, rank == failing and i == at, armed)

        out[name] = run_steps(ddp.join, batches[rank], step)
    # A join context after them, against PyTorch's DDP from the same parameters.
    reference = copy.deepcopy(model)
    theirs = TorchDDP(reference)
    sides = [("xgrad", [ddp], [model], ddp.join), ("torch", [theirs], [reference], theirs.join)]
    out["after"] = trained_after(sides, x, rank, lambda i: 1, lambda y: y.pow(2).mean())
    return out


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    return request.param, every_rank_ok(_run, request.param, timeout=60)


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_the_step_at_once_naming_the_rank(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    batches, failing, at = _case(name, world)
    boom = f"rank {failing} in forward: ValueError: boom"
    for rank, result in results.items():
        run = result[name]
        assert run["seconds"] < TIMEOUT / 2, (name, rank, run)  # never a timeout
        if at < batches[rank]:  # ran the step: raised there, once; left cleanly
            errors = [s for s in run["steps"] if s != "ok"]
            assert len(errors) == 1 and boom in errors[0], (name, rank, run)
            assert run["steps"].index(errors[0]) == at, (name, rank, run)
            assert run["left"] == "left", (name, rank, run)
        else:  # had joined: raises it as it leaves join()
            assert run["steps"][-1] == "ok", (name, rank, run)
            assert run["left"].startswith("RankError") and boom in run["left"], (name, rank, run)


def test_a_join_context_after_them_trains_as_pytorch(outcome: tuple[int, dict[int, Any]]) -> None:
    check_after_as_pytorch(outcome[1], rtol=1e-6)
