"""``PipelineRuntime.eval``: the forwards alone, as torch's ``schedule.eval``.

A validation loss needed a step, which ran the backward and added to ``.grad`` (under
``torch.no_grad()`` a step is refused). ``eval`` runs every stage's forward on every
microbatch, returns the last stage's outputs merged, fills ``losses=``, and touches no
gradient; a training step after it is the same as without it. On two gloo ranks, against
the whole model in one process.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

M, WIDTH = 4, 3
SCHEDULES = ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv", "dualpipev")


def _schedule(name: str) -> xp.Schedule:
    two = name in ("interleaved_1f1b", "zbv", "dualpipev")
    return xp.make(name, 2, M, chunks=2) if two else xp.make(name, 2, M)


def _stages(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).double() for _ in range(n)]


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * M, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(2 * M, WIDTH, generator=g, dtype=torch.float64)


def _run(rank: int, world: int, checkpoint: str) -> dict[str, Any]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    out: dict[str, Any] = {}
    for name in SCHEDULES:
        schedule = _schedule(name)
        stages = _stages(schedule.num_stages)
        mine = schedule.stages_of(rank)
        rt = PipelineRuntime(
            schedule, [stages[s] for s in mine], nn.MSELoss(), checkpoint=checkpoint, timeout=20
        )
        x, y = _data(1)
        losses: list[Any] = ["stale"]
        first = rt.eval(x, y, losses=losses)
        untouched = all(p.grad is None for s in mine for p in stages[s].parameters())
        bare: list[Any] = ["stale"]
        second = rt.eval(x, None, losses=bare)  # no targets: no loss
        loss = rt.step(*_data(2))  # a training step after: as without the evaluations
        third = rt.eval(x, y)
        out[name] = {
            "outputs": (first, second, third),
            "losses": (losses, bare),
            "untouched": untouched,
            "loss": loss,
            "grads": {s: [p.grad for p in stages[s].parameters()] for s in mine},
        }
    return out


def _whole(n: int) -> dict[str, Any]:
    stages = _stages(n)
    x, y = _data(1)
    with torch.no_grad():
        h = x
        for stage in stages:
            h = stage(h)
    losses = [nn.functional.mse_loss(a, b) for a, b in zip(h.chunk(M), y.chunk(M), strict=True)]
    x2, y2 = _data(2)
    h2 = x2
    for stage in stages:
        h2 = stage(h2)
    loss = nn.functional.mse_loss(h2, y2)
    loss.backward()
    grads = [[p.grad for p in stage.parameters()] for stage in stages]
    return {"outputs": h, "losses": losses, "loss": loss.detach(), "grads": grads}


@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
def test_eval_runs_the_forwards_alone(checkpoint: str) -> None:
    results = spawn(_run, 2, args=(checkpoint,), timeout=150)
    for name in SCHEDULES:
        schedule = _schedule(name)
        want = _whole(schedule.num_stages)
        last = schedule.placement[-1]
        for rank in (0, 1):
            got = results[rank][name]
            assert got["untouched"], (name, rank)  # eval added nothing to .grad
            for s, grads in got["grads"].items():
                for g, w in zip(grads, want["grads"][s], strict=True):
                    torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15, msg=name)
            if rank != last:
                assert got["outputs"] == (None, None, None) and got["loss"] is None
                assert got["losses"] == (["stale"], ["stale"])  # left as they are
                continue
            for out in got["outputs"]:
                torch.testing.assert_close(out, want["outputs"], rtol=1e-13, atol=0, msg=name)
                assert not out.requires_grad
            losses, bare = got["losses"]
            assert bare == []
            assert len(losses) == M
            for a, b in zip(losses, want["losses"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-13, atol=0, msg=name)
            torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-13, atol=0)


def _mixed(rank: int, world: int) -> tuple[float, str]:
    from xgrad.failure import RankError
    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make("1f1b", 2, M)
    rt = PipelineRuntime(schedule, [_stages(2)[rank]], nn.MSELoss(), timeout=4)
    x, y = _data(1)
    rt.step(x, y)
    start = time.perf_counter()
    try:
        if rank == 0:
            rt.eval(x, y)  # its peer trains
        else:
            rt.step(x, y)
    except RankError as exc:
        return time.perf_counter() - start, str(exc)
    return time.perf_counter() - start, "ran"


def test_one_rank_evaluating_while_the_other_trains_fails_both_and_both_exit() -> None:
    """The evaluating rank waits in the schedule's agreement for a peer that never joins:
    both raise within the timeout, naming it, and both processes exit at once (the
    agreement's all-gather ran on the user's group, where it stayed pending and held each
    process at its exit until the launcher killed it)."""
    start = time.perf_counter()
    results = spawn(_mixed, 2, timeout=120)
    took = time.perf_counter() - start
    for seconds, message in results:
        assert "rank 0 in pipeline schedule (eval's forwards) agreement" in message, message
        assert seconds < 30, (seconds, message)  # a 4 s timeout, on a loaded machine
    assert took < 60, took  # not held until the launcher's 120 s
