"""Torch pipeline runtime on real gloo groups: loss and gradients equal the model run whole."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402
from xgrad.torch_backend.spawn import spawn  # noqa: E402

WIDTH, BATCH = 6, 12


def blocks(n: int) -> list[nn.Module]:
    """n small blocks (Linear + tanh), the same on every rank (seeded)."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).double().float() for _ in range(n)]


def batch() -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def grad(p: Any) -> Any:
    assert p.grad is not None, "a parameter got no gradient"
    return p.grad


def rel(a: Any, b: Any) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def reference(
    parts: list[nn.Module], order: list[int], x: Any, y: Any
) -> tuple[float, list[list[Any]]]:
    """Loss and per-partition gradients of the whole model on the whole batch."""
    for p in parts:
        p.zero_grad(set_to_none=True)
    out = x
    for i in order:
        out = parts[i](out)
    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    grads = [[grad(p).clone() for p in part.parameters()] for part in parts]
    for p in parts:
        p.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _cases(world: int) -> list[tuple[str, xp.Schedule, tuple[xp.Invocation, ...] | None]]:
    m = 2 * world  # microbatches
    cases: list[tuple[str, xp.Schedule, tuple[xp.Invocation, ...] | None]] = [
        (name, xp.make(name, world, m, chunks=2), None) for name in sorted(xp.SCHEDULES)
    ]
    if world == 2:
        # Rank 0's partition 0 is invoked first and last: a reused module.
        inv = xp.chain([(0, 0), (1, 0), (0, 0)])
        cases += [(f"reuse-{pol}", xp.from_invocations(inv, m, pol), inv) for pol in ("1f1b", "zb")]
    return cases


def _run_all(rank: int, world: int) -> tuple[dict[str, tuple[float | None, float]], list[str]]:
    x, y = batch()
    results: dict[str, tuple[float | None, float]] = {}
    for name, schedule, inv in _cases(world):
        n = schedule.num_stages
        if inv is None:
            parts = blocks(n)
            order = list(range(n))
            owner = {s: schedule.placement[s] for s in range(n)}
            mine = [parts[s] for s in schedule.stages_of(rank)]
            mine_ids = list(schedule.stages_of(rank))
        else:
            parts = blocks(2)  # partition (0, 0) -> parts[0], (1, 0) -> parts[1]
            order = [0, 1, 0]
            owner = {0: 0, 1: 1}
            mine = [parts[rank]]
            mine_ids = [rank]
        want_loss, want_grads = reference(parts, order, x, y)
        for checkpoint in ("always", "except_last", "never"):
            rt = xp_runtime(schedule, mine, inv, checkpoint)
            loss = rt.step(
                x if rank == owner[0] else None, y if schedule.placement[-1] == rank else None
            )
            err = 0.0
            for i, part in zip(mine_ids, mine, strict=True):
                for p, want in zip(part.parameters(), want_grads[i], strict=True):
                    err = max(err, rel(grad(p), want))
                part.zero_grad(set_to_none=True)
            loss_err = None if loss is None else abs(float(loss) - want_loss) / abs(want_loss)
            split = any(
                a.kind is xp.Kind.BACKWARD_INPUT and a.stage > 0 for a in schedule.actions[rank]
            )
            # Split backwards run W from the joins the I pass captured (none fell back).
            assert not split or any(rt._joins.plans.values()), (name, checkpoint)
            results[f"{name}/{checkpoint}"] = (loss_err, err)
    if world == 2:
        results["dropout/always=never"] = (None, _dropout_recomputed(rank, world))
        results["batchnorm/buffers"] = (None, _batchnorm_recomputed(rank, world))
    return results, _bad_arguments(rank, world)


def _dropout_recomputed(rank: int, world: int) -> float:
    """A recomputed forward draws the same dropout masks: "always" equals "never"."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    x, y = batch()
    grads = []
    for checkpoint in ("always", "never"):
        torch.manual_seed(0)
        part = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5), nn.Tanh())
        rt = PipelineRuntime(
            xp.one_f_one_b(world, 4), [part], nn.functional.mse_loss, checkpoint=checkpoint
        )
        torch.manual_seed(7 + rank)
        rt.step(x if rank == 0 else None, y if rank == world - 1 else None)
        grads.append(torch.cat([grad(p).flatten() for p in part.parameters()]))
    assert float(grads[1].norm()) > 0
    return rel(grads[0], grads[1])


def _batchnorm_recomputed(rank: int, world: int) -> float:
    """A recomputed forward leaves the buffers as the first left them: BatchNorm's running
    statistics (and its count of batches) equal the unpipelined model's in every mode."""
    import copy

    from xgrad.torch_backend.pipeline import PipelineRuntime

    x, y = batch()
    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)) for _ in range(world)]
    want = copy.deepcopy(parts)
    with torch.no_grad():
        for xs in x.chunk(4):
            for part in want:
                xs = part(xs)
    err = 0.0
    for checkpoint in ("always", "except_last", "never"):
        mine = copy.deepcopy(parts[rank])
        rt = PipelineRuntime(
            xp.one_f_one_b(world, 4), [mine], nn.functional.mse_loss, checkpoint=checkpoint
        )
        rt.step(x if rank == 0 else None, y if rank == world - 1 else None)
        for b, w in zip(mine.buffers(), want[rank].buffers(), strict=True):
            err = max(err, float((b.double() - w.double()).abs().max()))
    return err


def _bad_arguments(rank: int, world: int) -> list[str]:
    """The errors bad arguments give, checked before anything is sent."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    messages = []
    mse = nn.functional.mse_loss
    part = blocks(world)
    cases: list[tuple[xp.Schedule, dict[str, Any]]] = [
        (xp.gpipe(world, 2), {"checkpoint": "sometimes"}),
        (xp.gpipe(world, 2), {"timeout": 0}),
        (xp.gpipe(world + 1, 2), {}),
        (xp.interleaved_1f1b(world, world), {}),  # two stages per rank, one partition
    ]
    for schedule, kwargs in cases:
        try:
            PipelineRuntime(schedule, [part[rank]], mse, **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    rt = PipelineRuntime(xp.gpipe(world, 2), [part[rank]], mse)
    if 0 < rank < world - 1:
        return messages  # a middle stage takes no batch
    try:
        rt.step(torch.zeros(1, WIDTH), torch.zeros(1, WIDTH))
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def xp_runtime(schedule: xp.Schedule, mine: list[nn.Module], inv: Any, checkpoint: str) -> Any:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    return PipelineRuntime(
        schedule, mine, nn.functional.mse_loss, invocations=inv, checkpoint=checkpoint, timeout=60
    )


@pytest.mark.parametrize("world", [2, 3])
def test_every_schedule_matches_the_whole_model(world: int) -> None:
    outcome = spawn(_run_all, world, timeout=150)
    per_rank = [results for results, _ in outcome]
    keys = per_rank[0].keys()
    assert len(keys) == 3 * (len(xp.SCHEDULES) + (2 if world == 2 else 0)) + 2 * (world == 2)
    for key in keys:
        losses = [r[key][0] for r in per_rank if r[key][0] is not None]
        if not key.startswith(("dropout", "batchnorm")):
            assert len(losses) == 1, key  # exactly the last stage's rank reports the loss
            assert losses[0] <= 1e-6, (key, losses)
        for r, res in enumerate(per_rank):
            assert res[key][1] <= 1e-6, (key, r, res[key][1])
    for rank, (_, messages) in enumerate(outcome):
        assert len(messages) == (4 if 0 < rank < world - 1 else 5), messages
        assert "checkpoint must be one of" in messages[0] and "'sometimes'" in messages[0]
        assert "timeout must be positive" in messages[1]
        assert f"rank {rank}: schedule has {world + 1} ranks, the group {world}" in messages[2]
        assert f"rank {rank}: needs partitions for slots [0, 1], got 1" in messages[3]
        assert all("batch size 1 is smaller than the 2 microbatches" in e for e in messages[4:])


def _one_bad_batch(rank: int, world: int, rows: list[int]) -> list[str]:
    """Rank 1 (the last stage) gets targets of ``rows[k]`` rows at step k (3 cannot be split
    into 4 microbatches), rank 0 good inputs. What each step raised ("ok" when nothing)."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    part = blocks(world)[rank]
    rt = PipelineRuntime(xp.one_f_one_b(world, 4), [part], nn.functional.mse_loss, timeout=2)
    x, y = batch()
    outcome = []
    for n in rows:
        try:
            rt.step(x if rank == 0 else None, y[:n] if rank == world - 1 else None)
            outcome.append("ok")
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")
    return outcome


def test_a_batch_one_rank_cannot_split_fails_that_step_on_every_rank() -> None:
    """On a step that starts without collectives (not the first), the bad batch used to
    be raised on its rank only: the others ran that step against its next call
    ("ok" with the next targets) and every later step stayed shifted by one."""
    from ranks import run_ranks

    results, _ = run_ranks(_one_bad_batch, 2, ([BATCH, 3, BATCH],), timeout=30)
    zero, one = results[0][1], results[1][1]
    assert one[1].startswith(
        "ValueError: rank 1: targets batch size 3 is smaller than the 4 microbatches"
    )
    assert zero[1].startswith("RankError: rank 1: step failed: ValueError: rank 1: targets"), zero
    assert zero[0] == zero[2] == one[0] == one[2] == "ok", results


def test_a_bad_batch_on_the_first_step_fails_that_step_on_every_rank() -> None:
    """The first step, and one after a failure, start by making the step's private group;
    the bad batch was raised before it, the peers waited in ``new_group`` and paired their
    step with the failing rank's next call. Steps: bad, good, bad (a settled step), bad
    (after a failure), good."""
    from ranks import run_ranks

    results, _ = run_ranks(_one_bad_batch, 2, ([3, BATCH, 3, 3, BATCH],), timeout=30)
    zero, one = results[0][1], results[1][1]
    for k in (0, 2, 3):
        assert one[k].startswith("ValueError: rank 1: targets batch size 3 is smaller than"), one
        assert zero[k].startswith("RankError: rank 1: step failed: ValueError: rank 1:"), zero
    assert zero[1] == zero[4] == one[1] == one[4] == "ok", results


def _late_failure(rank: int, world: int) -> list[Any]:
    """Rank 0 fails in its last action (0B3 of 1F1B), after rank 1 finished the step's
    actions; rank 1 waits a moment before its next step. Per step: "ok" with the largest
    gradient error against the whole model, or the error, with the seconds ``step`` took;
    then the warnings the step gave."""
    import time
    import warnings

    from xgrad.torch_backend.pipeline import PipelineRuntime

    parts = [p.double() for p in blocks(world)]
    part = parts[rank]
    x, y = (t.double() for t in batch())
    _, want = reference(parts, list(range(world)), x, y)
    calls, armed = [0], [False]

    def hook(g: Any) -> Any:
        calls[0] += 1
        if armed[0] and rank == 0 and calls[0] == 4:
            time.sleep(0.3)  # a long last backward: rank 1 is done with its actions by now
            raise RuntimeError("boom in the last backward")
        return g

    part[0].weight.register_hook(hook)
    rt = PipelineRuntime(
        xp.one_f_one_b(world, 4), [part], nn.functional.mse_loss, checkpoint="never", timeout=5
    )
    outcome: list[Any] = []
    for k in range(4):
        armed[0], calls[0] = k == 1, 0
        part.zero_grad(set_to_none=True)
        if k == 2 and rank == 1:
            time.sleep(1.0)  # the user's code between steps (optimizer, data)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.monotonic()
            try:
                rt.step(x if rank == 0 else None, y if rank == world - 1 else None)
                err = max(
                    rel(p.grad, w) for p, w in zip(part.parameters(), want[rank], strict=True)
                )
                outcome.append(("ok", err, time.monotonic() - start))
            except Exception as exc:
                outcome.append((type(exc).__name__, str(exc), time.monotonic() - start))
        outcome.append([str(w.message) for w in caught if w.category is RuntimeWarning])
    # The README's way to drop the group after a failure, with failed steps' groups retired.
    from xgrad.torch_backend.failure import abort_group

    try:
        abort_group()
        outcome.append("aborted")
    except Exception as exc:
        outcome.append(f"{type(exc).__name__}: {exc}")
    return outcome


@pytest.fixture(scope="module")
def late_failure() -> dict[int, Any]:
    from ranks import run_ranks

    results, _ = run_ranks(_late_failure, 2, timeout=40)
    return results


def test_a_failure_after_a_peer_finished_the_step_leaves_the_next_steps_working(
    late_failure: dict[int, Any],
) -> None:
    """...without a warning anywhere, and ``abort_group()`` then drops every group (the
    failed step's retired one too)."""
    assert sorted(late_failure) == [0, 1], late_failure  # nobody hung in new_group
    for rank in range(2):
        status, out = late_failure[rank]
        assert status == "ok", out
        steps = out[:-1:2]
        for k in (0, 2, 3):
            assert steps[k][0] == "ok" and steps[k][1] < 1e-12, (rank, k, steps)
        assert out[1:-1:2] == [[], [], [], []], out  # no RuntimeWarning
    assert [late_failure[rank][1][-1] for rank in range(2)] == ["aborted", "aborted"]


def test_a_failure_after_a_peer_finished_the_step_raises_on_every_rank(
    late_failure: dict[int, Any],
) -> None:
    """Rank 1 waits at the step's end for every rank (the end-of-step exchange), so rank
    0's failure in its last backward, which sends nothing, is raised there too, promptly
    (the timeout is 5 s; rank 0 fails 0.3 s into its last action)."""
    for rank in range(2):
        status, out = late_failure[rank]
        assert status == "ok", out
        kind, text, seconds = out[2]
        assert kind == "RankError", out
        assert text == "rank 0: 0B3 failed: RuntimeError: boom in the last backward", out
        assert seconds < 3.0, (rank, seconds)


def _first_action_fails(rank: int, world: int, name: str) -> list[Any]:
    """Rank 0 fails its first action (inputs of the wrong width), then two good steps; the
    outcomes and the seconds the first good step took."""
    import time

    from xgrad.torch_backend.pipeline import PipelineRuntime

    schedule = xp.make(name, world, 4)
    parts = blocks(schedule.num_stages)
    rt = PipelineRuntime(
        schedule, [parts[k] for k in schedule.stages_of(rank)], nn.functional.mse_loss, timeout=5
    )
    first, last = schedule.placement[0] == rank, schedule.placement[-1] == rank
    x, y = batch()
    outcome: list[Any] = []
    for inputs in (torch.zeros(BATCH, WIDTH + 1), x, x):
        start = time.monotonic()
        try:
            rt.step(inputs if first else None, y if last else None)
            outcome.append("ok")
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")
        outcome.append(time.monotonic() - start)
    return outcome


@pytest.fixture(scope="module")
def first_action_fails() -> tuple[dict[int, Any], dict[int, Any]]:
    from ranks import run_ranks

    return run_ranks(_first_action_fails, 2, args=("zbv",), timeout=40)


def test_a_rank_exits_cleanly_after_a_peer_failed_its_first_action(
    first_action_fails: tuple[dict[int, Any], dict[int, Any]],
) -> None:
    """zbv (two stages per rank): the peer used to poison the failing rank too, which never
    took it; the waiter thread left on that send aborted the process at exit (SIGABRT)."""
    results, codes = first_action_fails
    for rank in range(2):
        status, out = results[rank]
        assert status == "ok", out
        assert out[0].startswith("RankError: rank 0: 0F0 failed: RuntimeError"), out
        assert out[2] == out[4] == "ok", out
    assert codes == {0: 0, 1: 0}


def test_the_step_after_a_failure_does_not_wait_out_the_timeout(
    first_action_fails: tuple[dict[int, Any], dict[int, Any]],
) -> None:
    """It used to wait the whole timeout (5 s here): the failing rank poisons every edge a
    peer still expects, the peer takes one and raises, and the next step waited for the
    others to be received (never) before aborting the failed step's group."""
    results, _ = first_action_fails
    assert all(results[rank][1][3] < 3.0 for rank in range(2)), results


class _Interruptible(nn.Module):
    """A stage whose forward raises KeyboardInterrupt (Ctrl-C) when told to."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.rank = rank
        self.interrupt = False

    def forward(self, x: Any) -> Any:
        if self.interrupt:
            raise KeyboardInterrupt(f"ctrl-c on rank {self.rank}")
        return self.lin(x)


def _interrupted(rank: int, world: int) -> list[tuple[str, float]]:
    import time

    from xgrad.torch_backend.pipeline import PipelineRuntime

    torch.manual_seed(0)
    stage = _Interruptible(rank)
    rt = PipelineRuntime(xp.one_f_one_b(world, 4), [stage], nn.functional.mse_loss, timeout=20)
    x, y = torch.randn(8, 3), torch.randn(8, 3)
    out = []
    for interrupt in (True, False):
        stage.interrupt = interrupt and rank == 1
        start = time.monotonic()
        try:
            rt.step(x if rank == 0 else None, y if rank == world - 1 else None)
            out.append(("ok", time.monotonic() - start))
        except BaseException as exc:  # KeyboardInterrupt on rank 1
            out.append((f"{type(exc).__name__}: {exc}", time.monotonic() - start))
        stage.zero_grad()
    return out


def test_a_keyboard_interrupt_in_a_stage_reaches_every_stage_and_the_next_step_works() -> None:
    """It skipped the failure path: the others waited out the timeout, the next step too."""
    from ranks import run_ranks

    results, codes = run_ranks(_interrupted, 3, timeout=60)
    assert all(code == 0 for code in codes.values()), (codes, results)
    for rank in range(3):
        (first, took), (second, _) = results[rank][1]
        want = (
            "KeyboardInterrupt: ctrl-c on rank 1"
            if rank == 1
            else ("RankError: rank 1: 1F0 failed: KeyboardInterrupt: ctrl-c on rank 1")
        )
        assert first == want, (rank, first)
        assert took < 5.0, (rank, took)
        assert second == "ok", (rank, second)
