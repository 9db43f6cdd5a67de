"""The DDP on the failure channel, with real gloo ranks that raise, die and freeze.

One run of three ranks goes through a sequence of steps on one DDP: failures on one
rank (comm hook, forward, a user's backward hook) and on every rank (comm hook), each
followed by a step whose gradients must equal the full batch's. Two more runs kill and
freeze a rank: the survivors name it, ``destroy_process_group()`` returns and they exit.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from typing import Any

import pytest
from garbage import xgrad_garbage
from ranks import run_ranks
from steps import grads_are, recorded

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
TIMEOUT = 6.0  # the DDP's timeout= in these runs
SHARD = 4


def _setup(rank: int, world: int, buffers: bool = False) -> tuple[Any, Any, Any, Any]:
    import torch
    from torch import nn

    os.environ.update(FAST)
    torch.manual_seed(0)
    layers = [nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)]
    if buffers:
        layers.insert(1, nn.BatchNorm1d(6))
    model = nn.Sequential(*layers)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(SHARD * world, 5, generator=g), torch.randn(SHARD * world, 2, generator=g)
    return model, x, y, torch


def _full_batch_grads(model: Any, x: Any, y: Any) -> dict[str, Any]:
    import copy

    ref = copy.deepcopy(model)
    ref.zero_grad()
    ((ref(x) - y) ** 2).mean().backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def _sequence(rank: int, world: int) -> list[dict[str, Any]]:
    """Steps of one DDP; per step what was raised, how fast, the warning, and correctness."""
    model, x, y, torch = _setup(rank, world)
    from xgrad.torch_backend import DistributedDataParallel

    xs, ys = x[rank * SHARD : (rank + 1) * SHARD], y[rank * SHARD : (rank + 1) * SHARD]
    plan: dict[int, tuple[str, set[int]]] = {
        1: ("hook", {1}),
        3: ("forward", {2}),
        5: ("hook", set(range(world))),
        7: ("backward", {1}),
    }
    step = [0]

    def hook(
        state: Any, bucket: torch.distributed.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        kind, ranks = plan.get(step[0], ("", set()))
        if kind == "hook" and rank in ranks:
            raise ValueError(f"boom in hook on rank {rank}")
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(state, bucket)

    def forward_fault(module: Any, inputs: Any) -> None:
        kind, ranks = plan.get(step[0], ("", set()))
        if kind == "forward" and rank in ranks:
            raise RuntimeError(f"boom in forward on rank {rank}")

    def backward_fault(grad: Any) -> Any:
        kind, ranks = plan.get(step[0], ("", set()))
        if kind == "backward" and rank in ranks:
            raise RuntimeError(f"boom in backward on rank {rank}")
        return grad

    expected = _full_batch_grads(model, x, y)  # no optimizer step: the same for every step
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    ddp.register_comm_hook(None, hook)
    model[0].register_forward_pre_hook(forward_fault)
    model[2].weight.register_hook(backward_fault)
    out = []
    for s in range(9):
        step[0] = s
        model.zero_grad()
        record: dict[str, Any] = {"step": s, "error": ""}

        def body(record: dict[str, Any] = record) -> None:
            ((ddp(xs) - ys) ** 2).mean().backward()  # (the user's line: steps[6]["warned_at"])
            record["correct"] = grads_are(model, expected)

        out.append(recorded(record, body))
    return out


@pytest.fixture(scope="module")
def sequence() -> dict[int, list[dict[str, Any]]]:
    results, codes = run_ranks(_sequence, 3, timeout=120)
    assert all(c == 0 for c in codes.values()), (codes, results)
    for _r, (status, value) in results.items():
        assert status == "ok", value
    return {r: v for r, (_, v) in results.items()}


def test_a_comm_hook_failing_on_one_rank_is_named_on_every_rank(sequence: Any) -> None:
    for _rank, steps in sequence.items():
        error = steps[1]["error"]
        assert "rank 1 in comm hook, bucket 0: ValueError: boom in hook on rank 1" in error, error
        assert steps[1]["origin"] == 1
        assert steps[1]["seconds"] < 2.0 + 3.0, steps[1]  # 2 s, with room for a loaded machine


def test_a_forward_failing_on_one_rank_is_named_on_every_rank(sequence: Any) -> None:
    for steps in sequence.values():
        assert "rank 2 in forward: RuntimeError: boom in forward on rank 2" in steps[3]["error"]
        assert steps[3]["seconds"] < 5.0


def test_a_failure_on_every_rank_names_one_and_the_next_step_warns_what_was_dropped(
    sequence: Any,
) -> None:
    for steps in sequence.values():
        assert "in comm hook, bucket 0: ValueError: boom in hook" in steps[5]["error"]
        assert "iteration" in steps[6]["warning"] and "dropped" in steps[6]["warning"]
        # At the user's ddp(x) line, not inside torch's Module.__call__ or xgrad.
        assert steps[6]["warned_at"] == [__file__], steps[6]["warned_at"]


def test_a_users_backward_hook_failing_on_one_rank_is_named_and_bounded(sequence: Any) -> None:
    assert "boom in backward on rank 1" in sequence[1][7]["error"]
    for rank in (0, 2):
        error = sequence[rank][7]["error"]
        assert "rank 1 in backward" in error, error


def test_every_step_after_a_failure_gives_the_full_batch_gradients(sequence: Any) -> None:
    for rank, steps in sequence.items():
        for s in (0, 2, 4, 6, 8):
            assert steps[s]["error"] == "", (rank, steps[s])
            assert steps[s]["correct"], (rank, s)
        # Never the misleading "unused parameters" message after a failed backward.
        assert not any("Expected to have finished reduction" in st["error"] for st in steps)


def _peer_stops(rank: int, world: int, how: str) -> dict[str, Any]:
    """Rank 1 is killed or frozen before the forward pass (a buffer broadcast waits on it)."""
    model, x, y, _torch = _setup(rank, world, buffers=True)
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    ((ddp(x[:SHARD]) - y[:SHARD]) ** 2).mean().backward()
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    result: dict[str, Any] = {}
    with xgrad_garbage(result):
        start = time.monotonic()
        try:
            ((ddp(x[:SHARD]) - y[:SHARD]) ** 2).mean().backward()
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["origin"] = getattr(exc, "rank", None)
        result["seconds"] = time.monotonic() - start
        start = time.monotonic()
        try:  # the next step: the same named error again, not a hang
            ((ddp(x[:SHARD]) - y[:SHARD]) ** 2).mean().backward()
        except Exception as exc:
            result["again"] = f"{type(exc).__name__}: {exc}"
        result["again_seconds"] = time.monotonic() - start
    start = time.monotonic()
    dist.destroy_process_group()
    result["destroy_seconds"] = time.monotonic() - start
    return result


@pytest.mark.parametrize(("how", "world"), [("kill", 3), ("freeze", 2)])
def test_a_killed_or_frozen_peer_is_named_and_the_survivors_exit(how: str, world: int) -> None:
    results, codes = run_ranks(
        _peer_stops, world, (how,), timeout=90, frozen=[1] if how == "freeze" else []
    )
    for rank in [r for r in range(world) if r != 1]:
        status, value = results[rank]
        assert status == "ok", value
        assert value["origin"] == 1, value
        assert value["error"].startswith("RankUnresponsiveError: rank 1: stopped answering"), value
        assert value["seconds"] < TIMEOUT + 4.0, value
        assert value["again"] == value["error"], value
        assert value["again_seconds"] < 4.0, value
        assert value["destroy_seconds"] < TIMEOUT + 4.0, value
        assert value["garbage"] == [], value  # the failed steps left no reference cycle
        assert codes[rank] == 0


def _callback_raises(rank: int, world: int) -> tuple[str, float]:
    """A comm hook whose future's ``then`` callback raises (the hook's own code, on every
    rank): named at once, not after waiting for a peer's heartbeat to stop (15 s)."""
    import torch
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    def hook(
        state: Any, bucket: torch.distributed.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        work = dist.all_reduce(bucket.buffer(), group=state, async_op=True)

        def unpack(fut: Any) -> Any:
            raise ValueError(f"unpack failed on rank {rank}")

        return work.get_future().then(unpack)

    ddp = DistributedDataParallel(torch.nn.Linear(3, 2), timeout=30)
    ddp.register_comm_hook(None, hook)
    # Not timed: what a process's first DDP forward and first backward pass import (torch's
    # dynamo, about 1.2 s, and sympy), which took most of the bound on a loaded machine.
    import torch._dynamo

    torch.ones(1, requires_grad=True).sum().backward()
    start = time.monotonic()
    try:
        ddp(torch.ones(2, 3)).sum().backward()
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    return "no error", 0.0


def test_a_comm_hooks_callback_raising_is_named_within_two_seconds() -> None:
    from xgrad.torch_backend.spawn import spawn

    for message, seconds in spawn(_callback_raises, 2, timeout=60):
        assert "in comm hook hook, bucket 0: " in message, message
        assert "ValueError: unpack failed on rank " in message, message
        assert seconds < 2.0, (message, seconds)


def _two_ddps(rank: int, world: int) -> dict[str, Any]:
    """Two DDPs used in turn; rank 1's backward of the first fails at step 1 (a user's
    hook), and the next thing it runs is the second DDP, whose collectives need rank 0,
    which still waits in the first DDP's backward for rank 1's buckets."""
    model_a, x, y, torch = _setup(rank, world)
    torch.manual_seed(1)
    model_b = type(model_a)(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    from xgrad.torch_backend import DistributedDataParallel

    xs, ys = x[rank * SHARD : (rank + 1) * SHARD], y[rank * SHARD : (rank + 1) * SHARD]
    expected = {"a": _full_batch_grads(model_a, x, y), "b": _full_batch_grads(model_b, x, y)}
    step = [0]

    def fault(grad: Any) -> Any:
        if rank == 1 and step[0] == 1:
            raise RuntimeError("boom in backward on rank 1")
        return grad

    # The first layer's gradient comes last: the pass's reduction has begun when it fails.
    model_a[0].weight.register_hook(fault)
    ddps = {
        "a": (model_a, DistributedDataParallel(model_a, timeout=TIMEOUT)),
        "b": (model_b, DistributedDataParallel(model_b, timeout=TIMEOUT)),
    }
    out: dict[str, Any] = {}
    for s in range(4):
        step[0] = s
        for name, (model, ddp) in ddps.items():
            key = f"{name}{s}"
            model.zero_grad()
            start = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    ((ddp(xs) - ys) ** 2).mean().backward()
                    out[key] = all(
                        torch.allclose(p.grad, expected[name][n], rtol=1e-5, atol=1e-6)
                        for n, p in model.named_parameters()
                    )
                except Exception as exc:
                    out[key] = f"{type(exc).__name__}: {exc}"
            out[f"{key}_seconds"] = time.monotonic() - start
            out[f"{key}_warning"] = " | ".join(str(w.message) for w in caught)
    return out


def test_a_failed_backward_reaches_peers_at_the_next_forward_of_another_ddp() -> None:
    results, codes = run_ranks(_two_ddps, 2, timeout=90)
    assert all(c == 0 for c in codes.values()), (codes, results)
    out = {}
    for rank, (status, value) in results.items():
        assert status == "ok", value
        out[rank] = value
    assert "boom in backward on rank 1" in out[1]["a1"], out[1]
    error = out[0]["a1"]
    assert "rank 1 in backward" in error, error
    # Posted when rank 1 enters the other DDP, not when its timeout ends rank 0's wait.
    assert out[0]["a1_seconds"] < 2.0 + 2.0, out[0]
    for rank in (0, 1):
        assert out[rank]["b1"] is True, out[rank]
        assert out[rank]["b1_seconds"] < 2.0 + 2.0, out[rank]
        assert "dropped" in out[rank]["a2_warning"], out[rank]
        for key in ("a0", "b0", "a2", "b2", "a3", "b3"):
            assert out[rank][key] is True, (rank, key, out[rank])


def _one_more_step(rank: int, world: int, heartbeat: dict[str, str] = FAST) -> str:
    """Rank 1 runs one step more than rank 0 (no join): its reduction waits out the
    timeout, and the error says every rank still answers (nobody died)."""
    import torch
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update(heartbeat)
    ddp = DistributedDataParallel(torch.nn.Linear(3, 2), timeout=2)
    message = "no error"
    for _ in range(1 + rank):
        start = time.monotonic()
        try:
            ddp(torch.ones(2, 3)).sum().backward()
        except RuntimeError as exc:
            message = f"{time.monotonic() - start:.2f} {exc}"
    dist.barrier()
    return message


def test_a_rank_running_one_more_step_is_told_every_rank_still_answers() -> None:
    results, codes = run_ranks(_one_more_step, 2, timeout=60)
    assert codes == {0: 0, 1: 0}, codes
    assert results[0] == ("ok", "no error"), results
    status, message = results[1]
    assert status == "ok", message
    seconds, _, message = message.partition(" ")
    # Rank 0 is in a barrier, not in this step's collective: the late one (its heartbeat
    # publishes that it waits in no collective of this DDP).
    assert message.startswith(
        "rank 0: did not answer within the timeout (rank 1 waited for it in the collective)"
    ), message
    assert "every rank still answers: one that runs fewer steps" in message, message
    assert float(seconds) < 2.0 + 5.0, seconds


def test_a_timed_out_wait_among_live_ranks_raises_soon_after_its_timeout() -> None:
    """With the default 10 s heartbeat timeout: the heartbeats are read for 2 s after the
    wait's own 2 s timeout, not 1.5 heartbeat timeouts (the error came after 17 s)."""
    beat = {"XGRAD_HEARTBEAT_INTERVAL": "0.5", "XGRAD_HEARTBEAT_TIMEOUT": "10"}
    results, codes = run_ranks(_one_more_step, 2, args=(beat,), timeout=60)
    assert codes == {0: 0, 1: 0}, codes
    status, message = results[1]
    assert status == "ok", message
    seconds, _, message = message.partition(" ")
    assert "every rank still answers" in message, message
    assert float(seconds) < 2.0 + 5.0, seconds


def _interrupted_forward(rank: int, world: int) -> list[str]:
    """Ctrl-C in rank 1's forward: it used to skip the failure path, so rank 0's step
    reduced with rank 1's next one (silently wrong) and a later step timed out."""
    import torch

    from xgrad.torch_backend import DistributedDataParallel

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.interrupt = False

        def forward(self, x: Any) -> Any:
            if self.interrupt:
                raise KeyboardInterrupt(f"ctrl-c on rank {rank}")
            return self.lin(x)

    stage = Stage()
    ddp = DistributedDataParallel(stage, timeout=30)
    out = []
    for interrupt in (True, False, False):
        stage.interrupt = interrupt and rank == 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the dropped step's warning
                ddp(torch.ones(2, 3)).sum().backward()
            out.append("ok")
        except BaseException as exc:  # KeyboardInterrupt on rank 1
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_a_keyboard_interrupt_in_forward_reaches_every_rank_and_the_next_steps_work() -> None:
    results, codes = run_ranks(_interrupted_forward, 2, timeout=60)
    assert codes == {0: 0, 1: 0}, (codes, results)
    assert results[1][1] == ["KeyboardInterrupt: ctrl-c on rank 1", "ok", "ok"]
    assert results[0][1] == [
        "RankError: rank 1 in forward: KeyboardInterrupt: ctrl-c on rank 1",
        "ok",
        "ok",
    ]


def _own_exceptions(rank: int, world: int) -> dict[str, Any]:
    """A forward pass raising ValueError on every rank, then a comm hook raising KeyError
    on rank 1 only, each caught as user code catches it under PyTorch's DDP."""
    import torch

    from xgrad.failure import RankError
    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update(FAST)

    class Picky(torch.nn.Linear):
        bad = True

        def forward(self, x: Any) -> Any:
            if self.bad:
                raise ValueError(f"bad batch on rank {rank}")
            return super().forward(x)

    module = Picky(3, 2)
    ddp = DistributedDataParallel(module, timeout=TIMEOUT)
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ddp(torch.ones(2, 3))
        except ValueError as exc:  # PyTorch's DDP raises it as it is
            out["forward"] = (type(exc).__name__, isinstance(exc, RankError), str(exc))
        module.bad = False
        out["after"] = ddp(torch.ones(2, 3)).sum().backward() is None  # no warning: no pass cut
    out["warnings"] = [str(w.message) for w in caught]

    def hook(
        state: Any, bucket: torch.distributed.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        if rank == 1:
            raise KeyError("no such bucket")
        return torch.futures.Future()  # never completes: rank 1's failure ends the wait

    ddp.register_comm_hook(None, hook)
    try:
        ddp(torch.ones(2, 3)).sum().backward()
    except RankError as exc:
        out["hook"] = (type(exc).__name__, isinstance(exc, KeyError), str(exc))
    return out


def test_a_ranks_own_exception_is_caught_by_its_type_and_names_the_origin() -> None:
    results, codes = run_ranks(_own_exceptions, 2, timeout=90)
    assert codes == {0: 0, 1: 0}, (codes, results)
    out = {rank: value for rank, (status, value) in results.items() if status == "ok"}
    assert len(out) == 2, results
    for rank in (0, 1):
        kind, is_rank_error, text = out[rank]["forward"]
        assert kind == "RankError[ValueError]" and is_rank_error, out[rank]
        assert text.startswith("rank ") and " in forward: ValueError: bad batch on rank " in text
        assert out[rank]["after"] is True and out[rank]["warnings"] == [], out[rank]
    # Only rank 1's hook raised: there the error is also a KeyError; rank 0 gets the RankError.
    assert out[1]["hook"][:2] == ("RankError[KeyError]", True), out[1]
    assert out[0]["hook"][:2] == ("RankError", False), out[0]
    for rank in (0, 1):
        assert out[rank]["hook"][2].startswith("rank 1 in comm hook"), out[rank]
