"""The step's lanes (one private group per direction): the count and the direction of a
message, ranks that ask for different counts all opening the fewest (no hang in
``dist.new_group``), and a failed step on two lanes resets both so the next steps give
the whole model's gradients (real gloo ranks)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from chain import chain_setup, judged_step, worst_error

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402
from xgrad.torch_backend import pipeline_lanes  # noqa: E402
from xgrad.torch_backend.pipeline_lanes import (  # noqa: E402
    LANES_ENV,
    agree_lanes,
    default_lanes,
    lane_of,
)

WIDTH, BATCH, M = 5, 8, 4


def test_a_message_takes_the_lane_of_its_direction() -> None:
    assert [lane_of(0, 1, 2), lane_of(1, 0, 2), lane_of(3, 0, 2), lane_of(0, 3, 2)] == [0, 1, 1, 0]
    assert {lane_of(a, b, 1) for a in range(3) for b in range(3) if a != b} == {0}


def test_two_lanes_only_where_every_local_rank_has_a_cpu(monkeypatch: Any) -> None:
    monkeypatch.delenv(LANES_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(pipeline_lanes, "_usable_cpus", lambda: 2)
    assert [default_lanes(2), default_lanes(3), default_lanes(4)] == [2, 1, 1]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 4 ranks on two machines
    assert default_lanes(4) == 2
    monkeypatch.setenv(LANES_ENV, "1")
    assert default_lanes(2) == 1
    for bad in ("3", "0", "two"):
        monkeypatch.setenv(LANES_ENV, bad)
        with pytest.raises(ValueError, match=LANES_ENV):
            default_lanes(2)
    monkeypatch.delenv(LANES_ENV)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "many")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        default_lanes(2)


def test_every_rank_opens_the_fewest_lanes_any_rank_asked_for() -> None:
    assert agree_lanes([2, 2, 2]) == 2
    assert agree_lanes([2, 2, 1]) == agree_lanes([1, 2]) == 1
    with pytest.raises(ValueError, match=r"lane counts \[2, 3\]: expected 1 or 2"):
        agree_lanes([2, 3])


def _setup(rank: int, world: int) -> tuple[Any, Any, Any, list[list[Any]]]:
    return chain_setup(rank, world, WIDTH, BATCH)


def _mismatched_lanes(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 asks for one lane, rank 1 for two; two steps: the lanes opened, per step
    the largest relative error of this rank's gradients against the whole model's."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    os.environ[LANES_ENV] = "1" if rank == 0 else "2"
    part, x, y, want = _setup(rank, world)
    rt = PipelineRuntime(xp.one_f_one_b(world, M), [part], nn.functional.mse_loss, timeout=5)
    errors = []
    for _ in range(2):
        part.zero_grad(set_to_none=True)
        rt.step(x if rank == 0 else None, y if rank == world - 1 else None)
        errors.append(worst_error(part, want[rank]))
    return {"lanes": len(rt._p2p or ()), "errors": errors}


def test_ranks_that_ask_for_different_lane_counts_all_open_the_fewest() -> None:
    """Before, such ranks were refused with a DisagreementError (and before that they
    would have waited in a second ``dist.new_group``): one node's setting, or fewer cores
    on one machine, is a choice of speed the pipeline can agree on."""
    from ranks import run_ranks

    results, codes = run_ranks(_mismatched_lanes, 2, timeout=60)
    for rank in range(2):
        status, out = results[rank]
        assert status == "ok", out
        assert out["lanes"] == 1, out
        assert all(e < 1e-12 for e in out["errors"]), out
    assert codes == {0: 0, 1: 0}


def _fails_on_two_lanes(rank: int, world: int) -> tuple[int, list[Any]]:
    """1F1B on two lanes; in step 2 the last rank raises in its third loss (activations
    and gradients in flight on both lanes). Four steps: per step the outcome ("ok" with
    the largest relative error of this rank's gradients) and its seconds."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    os.environ[LANES_ENV] = "2"
    part, x, y, want = _setup(rank, world)
    calls, armed = [0], [False]

    def loss_fn(out: Any, target: Any) -> Any:
        calls[0] += 1
        if armed[0] and calls[0] == 3:
            raise RuntimeError("boom in the third loss")
        return nn.functional.mse_loss(out, target)

    rt = PipelineRuntime(xp.one_f_one_b(world, M), [part], loss_fn, timeout=5)
    outcome: list[Any] = []
    for k in range(4):
        armed[0], calls[0] = k == 1, 0
        part.zero_grad(set_to_none=True)
        outcome.append(judged_step(rt, part, want[rank], x, y))
    return len(rt._p2p or ()), outcome  # the lanes of the last step


def test_a_failed_step_on_two_lanes_resets_both_and_the_next_steps_work() -> None:
    from ranks import run_ranks

    results, codes = run_ranks(_fails_on_two_lanes, 2, timeout=60)
    for rank in range(2):
        status, (lanes, out) = results[rank]
        assert status == "ok", out
        assert lanes == 2, results
        assert out[1][0].startswith("RankError: rank 1: "), out
        assert "boom in the third loss" in out[1][0], out
        assert out[1][1] < 4.0, out  # raised at once, not after the 5 s timeout
        for k in (0, 2, 3):
            (status_k, error), seconds = out[k]
            assert status_k == "ok" and error < 1e-12, out
            assert seconds < 4.0, out
    assert codes == {0: 0, 1: 0}
