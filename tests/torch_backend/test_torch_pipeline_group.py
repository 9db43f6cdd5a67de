"""The step's private group: a rank whose peer never starts the step is told within the
runtime's ``timeout`` (``dist.new_group`` alone would wait for the default group's)."""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402

WIDTH = 4


def _peer_never_starts(rank: int, world: int) -> Any:
    """Rank 0 steps with a 1 s timeout; rank 1 stays alive and never calls ``step``."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    torch.manual_seed(0)
    rt = PipelineRuntime(
        xp.gpipe(world, 2), [nn.Linear(WIDTH, WIDTH)], nn.functional.mse_loss, timeout=1.0
    )
    if rank == 1:
        time.sleep(6.0)
        return "idle"
    start = time.monotonic()
    try:
        rt.step(torch.zeros(4, WIDTH))
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok"


def test_a_peer_that_never_starts_the_step_is_named_within_the_timeout() -> None:
    from ranks import run_ranks

    results, _ = run_ranks(_peer_never_starts, 2, timeout=30)
    status, (kind, text, seconds) = results[0]
    assert status == "ok" and kind.startswith("Rank"), results
    assert "the start of the step" in text, text
    assert seconds < 5.0, seconds  # the 1 s timeout and a loaded machine, not 30 minutes
    assert results[1] == ("ok", "idle"), results


def _agreement_cut_short(rank: int, world: int) -> list[Any]:
    """Rank 0 agrees on the schedule, then fails its first action; rank 1's wait on the
    agreement's all-gather reads that failure before its waiter thread (slowed here, as a
    loaded machine may) reports the all-gather done. Then two good steps: per step the
    outcome and its seconds."""
    from xgrad.torch_backend import agreement, failure
    from xgrad.torch_backend.pipeline import PipelineRuntime

    class SlowWaiter(failure.Waiter):
        def _run(self) -> None:
            time.sleep(0.5)
            super()._run()

    def slow_wait(work: Any, channel: Any, **kwargs: Any) -> None:
        deadline = time.monotonic() + 5.0  # rank 0's failure, posted after its agreement
        while channel.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        agreement.wait_work = wait_work  # only the first step's
        wait_work(work, channel, waiter=SlowWaiter(), **kwargs)

    wait_work = agreement.wait_work
    if rank == 1:
        agreement.wait_work = slow_wait  # type: ignore[assignment]
    torch.manual_seed(0)
    rt = PipelineRuntime(
        xp.gpipe(world, 2), [nn.Linear(WIDTH, WIDTH)], nn.functional.mse_loss, timeout=5.0
    )
    outcome: list[Any] = []
    for inputs in (torch.zeros(4, WIDTH + 1), torch.zeros(4, WIDTH), torch.zeros(4, WIDTH)):
        start = time.monotonic()
        try:
            rt.step(inputs if rank == 0 else None, torch.zeros(4, WIDTH) if rank == 1 else None)
            outcome.append(("ok", time.monotonic() - start))
        except Exception as exc:
            outcome.append((f"{type(exc).__name__}: {exc}", time.monotonic() - start))
    return outcome


def test_a_failure_that_cuts_a_ranks_agreement_short_leaves_the_next_steps_working() -> None:
    """Rank 1 used to keep the failed step's group and to agree again alone (rank 0 had
    agreed), so the next step waited on a step rank 1 never started: its timeout on both
    ranks (seen as an occasional failure of the first-action test on a loaded machine)."""
    from ranks import run_ranks

    results, codes = run_ranks(_agreement_cut_short, 2, timeout=40)
    for rank in range(2):
        status, out = results[rank]
        assert status == "ok", out
        assert out[0][0].startswith("RankError: rank 0: 0F0 failed: RuntimeError"), out
        assert out[1][0] == out[2][0] == "ok", out
        assert out[1][1] < 3.0, out  # not the 5 s timeout
    assert codes == {0: 0, 1: 0}


def _failed_steps_keys(rank: int, world: int, rounds: int) -> dict[str, Any]:
    """Good steps, then ``rounds`` of a failed step (an action raising on rank 1, or targets
    the last rank cannot split) and a good one; the store's key count after each round."""
    import os

    import torch.distributed as dist
    from chain import chain_setup, judged_step
    from ranks import key_count

    from xgrad.torch_backend.pipeline import PipelineRuntime

    os.environ.update({"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"})
    store = dist.distributed_c10d._get_default_store()
    part, x, y, want = chain_setup(rank, world, WIDTH, 6)
    armed = [False]

    def hook(g: Any) -> Any:
        if armed[0] and rank == 1:
            raise RuntimeError("boom in backward")
        return g

    part[0].weight.register_hook(hook)
    rt = PipelineRuntime(xp.one_f_one_b(world, 3), [part], nn.functional.mse_loss, timeout=5)

    def step(kind: str = "") -> Any:
        armed[0] = kind == "action"
        part.zero_grad(set_to_none=True)
        return judged_step(rt, part, want[rank], x, y[:2] if kind == "batch" else y)[0]

    out: dict[str, Any] = {"good": [step(), step()], "failed": [], "after": []}
    out["baseline"] = key_count(store)
    for k in range(rounds):
        out["failed"].append(step(("action", "batch")[k % 2]))
        out["good"].append(step())
        out["after"].append(key_count(store))
    return out


def test_failed_steps_leave_no_keys_once_a_step_works_again() -> None:
    """Each failed step used to leave its failure tickets, the ranks' starts of the step
    after it and the addresses c10d wrote to make its fresh private group: 8 keys a failure
    on three ranks, for the rest of the run. A good step deletes them, and its own."""
    from ranks import run_ranks

    rounds = 4
    results, codes = run_ranks(_failed_steps_keys, 3, (rounds,), timeout=90)
    assert set(codes.values()) == {0}, (codes, results)
    for rank, (status, out) in sorted(results.items()):
        assert status == "ok", (rank, out)
        assert all(o[0] == "ok" and o[1] < 1e-12 for o in out["good"]), (rank, out)
        assert all("boom in backward" in e for e in out["failed"][::2]), (rank, out)
        assert all("smaller than the 3 microbatches" in e for e in out["failed"][1::2]), out
        assert out["after"] == [out["baseline"]] * rounds, (rank, out)


def _late_for_the_first_step(rank: int, world: int, after: int = 0) -> list[Any]:
    """Rank 1 comes to its first step (after ``after`` good ones) after rank 0's 1.5 s
    timeout ran out (rank 0 has started its next step meanwhile), then both step on."""
    import os

    from chain import chain_setup, judged_step

    from xgrad.torch_backend.pipeline import PipelineRuntime

    os.environ.update({"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"})
    part, x, y, want = chain_setup(rank, world, WIDTH, 4)
    rt = PipelineRuntime(xp.one_f_one_b(world, 2), [part], nn.functional.mse_loss, timeout=1.5)
    out = []
    for k in range(after + 4):
        if rank == 1 and k == after:
            time.sleep(2.5)
        part.zero_grad(set_to_none=True)
        out.append(judged_step(rt, part, want[rank], x, y))
    return out


def test_a_rank_later_than_the_timeout_is_told_and_the_next_steps_work() -> None:
    """Rank 1 saw every rank's start of the step (rank 0's too, though rank 0 had given
    it up) and waited in ``new_group`` for ever; whether a step goes on is now settled
    once for all ranks."""
    from ranks import run_ranks

    results, codes = run_ranks(_late_for_the_first_step, 2, timeout=60)
    assert set(codes.values()) == {0}, (codes, results)
    for rank in (0, 1):
        status, out = results[rank]
        assert status == "ok", (rank, out)
        assert "the start of the step" in out[0][0], (rank, out)
        assert all(o[0][0] == "ok" and o[0][1] < 1e-12 for o in out[-2:]), (rank, out)


def test_a_live_rank_late_for_a_later_step_is_said_late_not_gone() -> None:
    """Rank 0's receive from rank 1 runs out its timeout while rank 1 still beats: rank 1
    "did not answer within the timeout" (it said rank 1 "stopped answering"), soon after
    the timeout (the heartbeats are read 2 s more, not 1.5 heartbeat timeouts)."""
    from ranks import run_ranks

    results, codes = run_ranks(_late_for_the_first_step, 2, (1,), timeout=60)
    assert set(codes.values()) == {0}, (codes, results)
    status, out = results[0]
    assert status == "ok", out
    (text, seconds) = out[1]
    assert "rank 1: did not answer within the timeout" in text, out
    assert "every rank still answers" in text, out
    assert seconds < 1.5 + 2.0 + 3.0, out
    for rank in (0, 1):
        assert all(o[0][0] == "ok" and o[0][1] < 1e-12 for o in results[rank][1][-2:]), rank


class _Ordered(nn.Module):
    """A stage that, at its ``at``-th forward while armed, waits until ``posted`` failures
    of the step are in the store (read there: the runtime's channel would take the first
    for its own), then raises ``fail`` if it has one."""

    def __init__(self, at: int, posted: int, fail: str) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.at, self.posted, self.fail = at, posted, fail
        self.calls = 0
        self.runtime: Any = None  # armed: the runtime, whose step's channel is read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at and self.runtime is not None:
            channel = self.runtime._channel
            key = f"{channel.prefix}/failure/{self.posted}"
            deadline = time.monotonic() + 20.0
            while self.posted and not channel.store.check([key]):
                assert time.monotonic() < deadline, f"failure {self.posted} never posted"
                time.sleep(0.005)
            if self.fail:
                raise ValueError(self.fail)
        return torch.tanh(self.lin(x))


def _two_fail(rank: int, world: int) -> list[str]:
    """GPipe over 3 stages and 3 microbatches; in the first step rank 1 raises in its
    second forward (1F1), rank 0 in its third (0F2) once rank 1's failure is posted, and
    rank 2 holds its first (2F0) until both are, then takes the poison on 2F1's input.
    Then a good step. Per step: the error, or "ok"."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    torch.manual_seed(0)
    stage = _Ordered(*{0: (3, 1, "zero"), 1: (2, 0, "one"), 2: (1, 2, "")}[rank])
    rt = PipelineRuntime(
        xp.gpipe(world, 3), [stage], nn.functional.mse_loss, checkpoint="never", timeout=20
    )
    x, y = torch.zeros(6, WIDTH), torch.zeros(6, WIDTH)
    out: list[str] = []
    for runtime in (rt, None):
        stage.calls, stage.runtime = 0, runtime
        try:
            rt.step(x if rank == 0 else None, y if rank == 2 else None)
            out.append("ok")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_a_rank_names_every_rank_whose_failure_reached_it() -> None:
    """Two ranks fail in the same step: the third named the first one posted alone. Each
    rank now names every failure in the channel when it raises (rank 1 raised first, so
    it may not know of rank 0's yet)."""
    from ranks import run_ranks

    results, codes = run_ranks(_two_fail, 3, timeout=60)
    both = "rank 1: 1F1 failed: ValueError: one\nalso rank 0: 0F2 failed: ValueError: zero"
    assert results[0] == ("ok", [f"RankError[ValueError]: {both}", "ok"]), results
    assert results[2] == ("ok", [f"RankError: {both}", "ok"]), results
    status, out = results[1]
    assert status == "ok" and out[1] == "ok", results
    assert out[0].startswith("RankError[ValueError]: rank 1: 1F1 failed: ValueError: one"), out
    assert codes == {0: 0, 1: 0, 2: 0}
