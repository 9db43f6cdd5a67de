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
import tanh_stages as ts
import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

SCHEDULES = ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv", "dualpipev")


def _run(rank: int, world: int, checkpoint: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in SCHEDULES:
        stages, mine, rt = ts.runtime(name, rank, checkpoint=checkpoint, timeout=20)
        x, y = ts.data(1)
        losses: list[Any] = ["stale"]
        first = rt.eval(x, y, losses=losses)
        untouched = all(p.grad is None for s in mine for p in stages[s].parameters())
        bare: list[Any] = ["stale"]
        second = rt.eval(x, None, losses=bare)  # no targets: no loss
        loss = rt.step(*ts.data(2))  # a training step after: as without the evaluations
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
    stages = ts.stages(n)
    x, y = ts.data(1)
    with torch.no_grad():
        h = x
        for stage in stages:
            h = stage(h)
    losses = [
        nn.functional.mse_loss(a, b) for a, b in zip(h.chunk(ts.M), y.chunk(ts.M), strict=True)
    ]
    x2, y2 = ts.data(2)
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
        schedule = ts.schedule(name)
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
            assert len(losses) == ts.M
            for a, b in zip(losses, want["losses"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-13, atol=0, msg=name)
            torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-13, atol=0)


def _mixed(rank: int, world: int) -> tuple[float, str]:
    from xgrad.failure import RankError
    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make("1f1b", 2, ts.M)
    rt = PipelineRuntime(schedule, [ts.stages(2)[rank]], nn.MSELoss(), timeout=4)
    x, y = ts.data(1)
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
        # Both wait out the same 4 s: rank 0 in the agreement, rank 1 for rank 0's first
        # activation. Which is posted first is a race (under load rank 1's, which names
        # rank 0 as the one that did not answer); either names rank 0.
        assert (
            "rank 0 in pipeline schedule (eval's forwards) agreement" in message
            or "rank 0: did not answer within the timeout: rank 1's 1RECV_F0" in message
        ), message
        assert seconds < 30, (seconds, message)  # a 4 s timeout, on a loaded machine
    assert took < 60, took  # not held until the launcher's 120 s


class _Failing(nn.Module):
    """A stage that raises in forward while ``fail`` is set."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("boom in eval")
        return self.block(x)


def _replicated(rank: int, world: int, mode: str) -> list[str]:
    """Two pipelines of two stages, two replicas (DDP stages, or ``dp_group``): the first
    call is an eval that fails on rank 0; then two steps, each checked against the whole
    model in one process."""
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.pipeline import PipelineRuntime

    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, place = divmod(rank, 2)
    stages = ts.stages(2)
    stage = _Failing(stages[place])
    if mode == "ddp":
        ddp = DistributedDataParallel(stage, process_group=replicas[place], timeout=15)
        rt = PipelineRuntime(
            xp.make("1f1b", 2, ts.M), [ddp], nn.MSELoss(), group=pipelines[replica],
            timeout=15, no_sync=lambda i: ddp.no_sync(),
        )  # fmt: skip
    else:
        rt = PipelineRuntime(
            xp.add_stage_ops(xp.make("zb_h1", 2, ts.M)), [stage], nn.MSELoss(),
            group=pipelines[replica], timeout=15, dp_group=replicas[place],
        )  # fmt: skip
    out = []
    x, y = ts.data(1)
    stage.fail = rank == 0
    try:
        rt.eval(x if place == 0 else None, y if place == 1 else None)
        out.append("eval ran")
    except Exception as exc:
        out.append(f"eval raised {type(exc).__name__}")
    stage.fail = False
    for seed in (2, 3):
        stages[place].zero_grad(set_to_none=True)
        x, y = ts.data(seed)
        try:
            rt.step(x if place == 0 else None, y if place == 1 else None)
        except Exception as exc:
            out.append(f"step raised {type(exc).__name__}: {exc}")
            continue
        whole = ts.stages(2)
        nn.functional.mse_loss(whole[1](whole[0](x)), y).backward()
        worst = max(
            float((p.grad - q.grad).abs().max())  # type: ignore[operator]
            for p, q in zip(stages[place].parameters(), whole[place].parameters(), strict=True)
        )
        out.append("step ok" if worst < 1e-12 else f"step off by {worst:.3g}")
    return out


@pytest.mark.parametrize("mode", ["dp_group", "ddp"])
def test_a_failed_eval_leaves_the_replicas_next_steps_right(mode: str) -> None:
    """An eval reduces nothing, yet its failure told the data-parallel replicas: it began
    a step of theirs on the failing replica only, whose next all-reduce then paired with
    the other replica's next step (``dp_group``: gradients off by 0.1 without a word), and
    a DDP stage's forward posted it to the DDP's step (the replicas' next step raised it)."""
    results = spawn(_replicated, 4, args=(mode,), timeout=150)
    for rank, out in enumerate(results):
        first = (
            ["eval raised RankError[ValueError]", "eval raised RankError"][rank]
            if rank < 2
            else "eval ran"
        )
        assert out == [first, "step ok", "step ok"], (rank, out)


_QUICK = "next step well within the timeout"


def _next_step(seconds: float) -> str:
    """How long the step after a failure took, against the runtime's 6 s timeout (the bug
    waited it out); well under it on a loaded machine, where the process's first backward
    pass alone (a lazy import of torch's) took more than half a second."""
    return _QUICK if seconds < 3.0 else f"next step in {seconds} s"


def _after_switch(rank: int, world: int) -> list[str]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    rt = PipelineRuntime(xp.make("1f1b", 2, ts.M), [ts.stages(2)[rank]], nn.MSELoss(), timeout=6)
    x, y = ts.data(1)
    out = []
    rt.step(x, y)
    bad = torch.zeros(ts.M - 1, ts.WIDTH, dtype=torch.float64)  # fewer rows than microbatches
    for call in (rt.eval, rt.step):  # a bad batch at the first call after each switch
        try:
            call(bad if rank == 0 else None, y)
        except Exception as exc:
            out.append(type(exc).__name__)
        start = time.perf_counter()
        rt.step(x, y)
        out.append(_next_step(time.perf_counter() - start))
    return out


def test_a_bad_batch_right_after_a_switch_leaves_the_next_step_working() -> None:
    """The first call after a switch between step and eval splits its batch before the
    step's group is made; the failing rank kept its group while its peers reset theirs,
    and the next step waited out the timeout on every rank."""
    results = spawn(_after_switch, 2, timeout=120)
    assert results[0] == ["ValueError", _QUICK, "ValueError", _QUICK]
    assert results[1] == ["RankError", _QUICK, "RankError", _QUICK]


class _Uneven(nn.Module):
    """A last stage whose output has another structure for its last microbatch."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.lin = nn.Linear(ts.WIDTH, ts.WIDTH).double()

    def forward(self, x: torch.Tensor) -> Any:
        self.calls += 1
        y = self.lin(x)
        return {"y": y} if self.calls % ts.M else {"y": y, "extra": y}


def _unmergeable(rank: int, world: int) -> list[str]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    stage = ts.stages(1)[0] if rank == 0 else _Uneven()
    loss = lambda out, target: nn.functional.mse_loss(out["y"], target)  # noqa: E731
    rt = PipelineRuntime(xp.make("1f1b", 2, ts.M), [stage], loss, timeout=6)
    x, y = ts.data(1)
    out = []
    try:
        rt.eval(x, y)
        out.append("eval ran")
    except ValueError as exc:
        out.append("cannot be merged" if "cannot be merged" in str(exc) else str(exc))
    start = time.perf_counter()
    rt.step(x, y)
    out.append(_next_step(time.perf_counter() - start))
    return out


def test_outputs_that_cannot_be_merged_fail_the_last_rank_alone() -> None:
    """The merge ran inside the step, whose failure reset the last rank's group and not
    the others': the next step waited out the timeout."""
    results = spawn(_unmergeable, 2, timeout=120)
    assert results == [["eval ran", _QUICK], ["cannot be merged", _QUICK]]
