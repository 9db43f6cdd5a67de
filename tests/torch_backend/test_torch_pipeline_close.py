"""The end-of-step exchange on real gloo groups (3 ranks: the leader and two others): a
failure in a non-leader's last action, after every other rank finished its actions, is
raised on every rank in that step (through the leader); a rank killed or frozen in the
exchange is named by the others; the steps after a raise give the whole model's
gradients."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from chain import chain_setup, judged_step

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402

WIDTH, BATCH, M = 5, 6, 3


def _setup(rank: int, world: int) -> tuple[Any, Any, Any, list[list[Any]]]:
    return chain_setup(rank, world, WIDTH, BATCH)


def _last_w_fails(rank: int, world: int) -> list[Any]:
    """ZB-H1: rank 1's last action is a weight gradient (1W2), which sends nothing; it
    raises there 0.3 s late, when ranks 0 and 2 are done with their actions. Four steps:
    per step ``(outcome, seconds)``, the outcome "ok" with the largest relative error of
    this rank's gradients against the whole model's, or the error."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    part, x, y, want = _setup(rank, world)
    calls, armed = [0], [False]

    def hook(g: Any) -> Any:
        calls[0] += 1
        if armed[0] and rank == 1 and calls[0] == M:
            time.sleep(0.3)
            raise RuntimeError("boom in the last weight gradient")
        return g

    part[0].weight.register_hook(hook)
    rt = PipelineRuntime(xp.zb_h1(world, M), [part], nn.functional.mse_loss, timeout=5)
    outcome: list[Any] = []
    for k in range(4):
        armed[0], calls[0] = k == 1, 0
        part.zero_grad(set_to_none=True)
        outcome.append(judged_step(rt, part, want[rank], x, y))
    return outcome


def test_a_failure_in_a_last_action_that_sends_nothing_raises_everywhere_through_the_leader() -> (
    None
):
    from ranks import run_ranks

    results, codes = run_ranks(_last_w_fails, 3, timeout=60)
    for rank in range(3):
        status, out = results[rank]
        assert status == "ok", out
        failed, seconds = out[1]
        want = "RankError: rank 1: 1W2 failed: RuntimeError: boom in the last weight gradient"
        assert failed == want, (rank, out)
        assert seconds < 3.0, (rank, seconds)  # the timeout is 5 s
        for k in (0, 2, 3):
            (word, error), _ = out[k]
            assert word == "ok" and error < 1e-12, (rank, k, out)
    assert codes == {0: 0, 1: 0, 2: 0}


def _stops_in_the_exchange(rank: int, world: int, victim: int, how: str) -> Any:
    """One good step, then ``victim`` is killed or frozen as it starts the step's
    exchange (its actions all done); the others' error and the seconds it took."""
    import torch.distributed as dist

    from xgrad.torch_backend import pipeline_close
    from xgrad.torch_backend.pipeline import PipelineRuntime

    part, x, y, _ = _setup(rank, world)
    rt = PipelineRuntime(xp.one_f_one_b(world, M), [part], nn.functional.mse_loss, timeout=2)

    def step() -> None:
        rt.step(x if rank == 0 else None, y if rank == world - 1 else None)

    step()
    dist.barrier()
    if rank == victim:
        run = pipeline_close.StepClose.run

        def stop(self: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            run(self)

        pipeline_close.StepClose.run = stop  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        step()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", getattr(exc, "rank", None), time.monotonic() - start
    return "ok"


@pytest.mark.parametrize(("victim", "how"), [(1, "kill"), (0, "freeze")])
def test_a_rank_killed_or_frozen_in_the_exchange_is_named_by_the_others(
    victim: int, how: str
) -> None:
    """A non-leader killed (the leader sees its connection close, then tells the third
    rank) and the leader frozen (the others' waits run out the 2 s timeout)."""
    from ranks import run_ranks

    results, codes = run_ranks(
        _stops_in_the_exchange,
        3,
        (victim, how),
        timeout=60,
        frozen=[victim] if how == "freeze" else [],
    )
    for rank in [r for r in range(3) if r != victim]:
        status, out = results[rank]
        assert status == "ok", out
        text, origin, seconds = out
        assert origin == victim, out
        assert text.startswith(f"RankUnresponsiveError: rank {victim}: stopped answering"), out
        assert seconds < (5.0 if how == "kill" else 9.0), out
        assert codes[rank] == 0, codes


def _leader_dies_early(rank: int, world: int) -> Any:
    """One good step; in the next the leader is killed at its second forward while rank 2
    is 0.4 s late to its first action: rank 2 then posts the exchange's receive from the
    leader (at its first wait) on a connection already closed."""
    import torch.distributed as dist

    from xgrad.torch_backend.pipeline import PipelineRuntime

    part, x, y, _ = _setup(rank, world)
    armed = [False]
    rt = PipelineRuntime(xp.one_f_one_b(world, 2 * M), [part], nn.functional.mse_loss, timeout=8)
    perform = type(rt)._perform

    def late(self: Any, action: Any, *args: Any, **kwargs: Any) -> Any:
        if armed[0] and rank == 0 and str(action) == "0F1":
            os.kill(os.getpid(), signal.SIGKILL)
        if armed[0] and rank == 2 and action is self._actions[0]:
            time.sleep(0.4)  # before its first receive
        return perform(self, action, *args, **kwargs)

    type(rt)._perform = late  # type: ignore[method-assign]

    def step() -> None:
        rt.step(x if rank == 0 else None, y if rank == world - 1 else None)

    step()
    dist.barrier()
    armed[0] = True
    try:
        step()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", getattr(exc, "rank", None)
    return "ok"


def test_a_leader_dead_before_the_exchange_is_posted_is_named_not_the_live_rank() -> None:
    """Was "rank 2: 2F0 failed: RuntimeError: [...] Connection closed by peer" on ranks 1
    and 2: gloo refused the exchange's receive (or send) at once, outside the guarded
    waits, and the live rank was taken as the origin."""
    from ranks import run_ranks

    results, codes = run_ranks(_leader_dies_early, 3, timeout=60)
    for rank in (1, 2):
        status, out = results[rank]
        assert status == "ok", out
        text, origin = out
        assert origin == 0, (rank, out)
        assert text.startswith("RankUnresponsiveError: rank 0: stopped answering"), out
        assert codes[rank] == 0, codes
