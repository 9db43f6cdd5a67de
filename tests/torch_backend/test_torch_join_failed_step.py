"""Under ``join()``, the steps after a step whose forward pass raised on one rank work.

Rank ``r`` has ``3 + r`` batches; rank 1's forward pass raises at its second step. Every
rank raises that step's ``RankError`` naming rank 1, and every later step must train on
every rank, the ranks that ran out of inputs shadowing the others as ``join()`` does.

Before, the join round that step's forward pass opened was entered by the ranks that
reached its backward pass before they read the failure (with ``GO``, at their first
gradient hook) and never by rank 1, whose next forward pass's "not joined" all-reduce
met that ``GO``: rank 1 raised a spurious "ran a forward pass with gradients on and no
backward pass after it" at the next step, lost that batch, and every later count on the
group paired one rank's forward pass with another's next. With ``throw_on_early_termination``
the misaligned all-reduces summed a "not joined" 1 into the exhausted-inputs check.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from ranks import armed_linear, run_ranks

TIMEOUT = 4.0


def _failed_step_under_join(rank: int, world: int, throw: bool) -> dict[str, Any]:
    import torch

    from xgrad.failure_errors import RankError
    from xgrad.torch_backend import DistributedDataParallel

    model, armed = armed_linear()
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    x = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    model(x).pow(2).mean().backward()  # this rank's own gradient: the parameters never move
    local = [p.grad.clone().numpy() for p in model.parameters()]
    steps: list[Any] = []
    try:
        with ddp.join(throw_on_early_termination=throw):
            for i in range(3 + rank):
                model.zero_grad()
                armed[0] = rank == 1 and i == 1
                try:
                    ddp(x).pow(2).mean().backward()
                    steps.append([p.grad.clone().numpy() for p in model.parameters()])
                except RankError as exc:  # the failed step's; any other error leaves join()
                    steps.append(f"{type(exc).__name__}: {exc}")
        left = "left"
    except RuntimeError as exc:
        left = str(exc)
    return {"local": local, "steps": steps, "left": left}


@pytest.fixture(scope="module", params=[(2, False), (3, False), (3, True)])
def outcome(request: pytest.FixtureRequest) -> tuple[int, bool, dict[int, Any]]:
    world, throw = request.param
    results, codes = run_ranks(_failed_step_under_join, world, (throw,), timeout=60)
    assert all(code == 0 for code in codes.values()), (codes, results)
    assert all(status == "ok" for status, _ in results.values()), results
    return world, throw, {rank: value for rank, (_, value) in results.items()}


def test_every_rank_raises_the_failed_step_naming_rank_1(
    outcome: tuple[int, bool, dict[int, Any]],
) -> None:
    _, _, results = outcome
    for rank, result in results.items():
        assert isinstance(result["steps"][1], str), (rank, result["steps"])
        assert "rank 1 in forward: ValueError: boom" in result["steps"][1], result["steps"]


def test_the_steps_after_it_train_on_every_rank(
    outcome: tuple[int, bool, dict[int, Any]],
) -> None:
    world, throw, results = outcome
    for rank, result in results.items():
        after = result["steps"][2:]
        if throw:
            # Rank 0 runs out after its third step and raises PyTorch's words as it
            # leaves; the others raise theirs at their next forward pass.
            assert len(after) == 1, (rank, result)
            assert result["left"] == (
                "Rank 0 exhausted all inputs."
                if rank == 0
                else "Detected at least one rank that exhausted inputs. Throwing across all ranks."
            ), (rank, result)
        else:
            assert result["left"] == "left", (rank, result["left"])
            assert len(after) == 1 + rank, (rank, after)
        for i, grads in enumerate(after, start=2):
            assert not isinstance(grads, str), (rank, i, grads)
            training = [r for r in results if i < 3 + r]  # ranks with a batch at step i
            for j, got in enumerate(grads):
                want = sum(results[r]["local"][j] for r in training) / world
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{rank} {i}")
