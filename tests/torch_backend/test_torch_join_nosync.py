"""Under ``join()``, gradient accumulation (``no_sync``) with a step that fails while a rank has joined.

Gloo ranks, each scenario a join context of its own, in one run: each step is a
``no_sync`` pass (forward and backward), then a synchronised one. The ranks still
training begin a step at its accumulation's first pass; a rank that has joined shadows
the accumulation pass (no backward pass to match) and begins the step at the
synchronised pass's count. At step 1 one rank fails, and every rank catches the
failure per step (a ``try`` around the step's two passes) and goes on. Every rank that
ran the step must raise it there, once, naming the rank where it started; the steps
after it must train with the accumulated gradients of ``join()``; the rank that had
joined raises it as it leaves ``join()``; nobody waits out a timeout.

Rank 0 has one step, the others three; the last rank fails, at step 1:

* ``acc_forward``: its ``no_sync`` forward pass raises.
* ``acc_backward``: its ``no_sync`` backward pass raises (a hook on a weight's gradient).
* ``acc_even``: ``acc_forward`` with every rank at three steps (none joins).
* ``sync_forward``: its synchronised forward pass raises.
* ``sync_hook``: its communication hook raises in the synchronised backward pass.

Before, an accumulation pass's failure was posted to the step the ranks still training
began at that pass, which the joined rank had not begun (it began it at the synchronised
pass's count): the failing rank made the fresh group of the step after it alone, every
rank timed out (3 s), and the contexts after it failed too.

A rank whose step failed in a ``no_sync`` pass skips the step's synchronised pass (a
``try`` per step), which the other ranks still training run: their count met that rank's
next step's, pairing one step's pass with the next's (at three ranks, or with no rank
joined, "ran different forward passes" or a wait to the timeout). Now it sends a count
standing in for the pass it skips, which makes them raise the step's failure there.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from ranks import armed_hook, every_rank_ok

TIMEOUT = 3.0


def _batches(world: int, name: str = "") -> list[int]:
    """Batches of rank 0, 1, ...: rank 0 joins after one, but in ``acc_even``."""
    return [3] * world if name == "acc_even" else [1] + [3] * (world - 1)


WHERE = {
    "acc_forward": "forward: ValueError: boom",
    "acc_backward": "backward: ValueError: grad boom",
    "acc_even": "forward: ValueError: boom",
    "sync_forward": "forward: ValueError: boom",
    "sync_hook": "comm hook, bucket 0: ValueError: hook boom",
}
AT = 1


def _contexts(rank: int, world: int) -> dict[str, Any]:
    import torch

    from xgrad.failure_errors import RankError
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    trip = {"forward": False, "backward": False}

    def pre_hook(module: Any, inputs: Any) -> None:
        if trip["forward"]:
            trip["forward"] = False
            raise ValueError("boom")

    def grad_hook(grad: torch.Tensor) -> torch.Tensor:
        if trip["backward"]:
            trip["backward"] = False
            raise ValueError("grad boom")
        return grad

    model.register_forward_pre_hook(pre_hook)
    model.weight.register_hook(grad_hook)
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    comm_hook, hook_armed = armed_hook()
    ddp.register_comm_hook(None, comm_hook)
    x = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    model(x).pow(2).mean().backward()  # this rank's own gradient: the parameters never move
    out: dict[str, Any] = {"local": [p.grad.clone().numpy() for p in model.parameters()]}

    def loss(pass_: str, name: str, failing: bool) -> Any:
        trip["forward"] = failing and name.replace("_even", "_forward") == f"{pass_}_forward"
        hook_armed[0] = failing and name == f"{pass_}_hook"
        trip["backward"] = failing and name == f"{pass_}_backward"
        return ddp(x).pow(2).mean()

    for name in [*WHERE, "after"]:
        steps: list[Any] = []
        started = time.monotonic()
        try:
            with ddp.join():
                for i in range(_batches(world, name)[rank]):
                    model.zero_grad()
                    failing = rank == world - 1 and i == AT
                    try:
                        with ddp.no_sync():
                            loss("acc", name, failing).backward()
                        loss("sync", name, failing).backward()
                        steps.append([p.grad.clone().numpy() for p in model.parameters()])
                    except (RankError, ValueError) as exc:
                        steps.append(f"{type(exc).__name__}: {exc}")
            left = "left"
        except RuntimeError as exc:
            left = f"{type(exc).__name__}: {exc}"
        out[name] = {"steps": steps, "left": left, "seconds": time.monotonic() - started}
    return out


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    world = request.param
    return world, every_rank_ok(_contexts, world, timeout=90)


def _check_grads(results: dict[int, Any], world: int, name: str) -> None:
    """Each step trained: two passes' gradients of each rank with a batch then, summed,
    over the world size (the synchronised pass reduces what the accumulation left)."""
    batches = _batches(world, name)
    for rank, result in results.items():
        for i, grads in enumerate(result[name]["steps"]):
            if isinstance(grads, str):
                continue
            training = [r for r in results if i < batches[r]]
            for j, got in enumerate(grads):
                want = 2 * sum(results[r]["local"][j] for r in training) / world
                np.testing.assert_allclose(
                    got, want, rtol=1e-5, atol=1e-6, err_msg=f"{name} rank {rank} step {i}"
                )


@pytest.mark.parametrize("name", list(WHERE))
def test_every_rank_raises_the_step_once_and_the_steps_after_it_train(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    batches, failing = _batches(world, name), world - 1
    boom = f"rank {failing} in {WHERE[name]}"
    for rank, result in results.items():
        run = result[name]
        steps = run["steps"]
        assert run["seconds"] < TIMEOUT / 2, (name, rank, run)  # never a timeout
        assert len(steps) == batches[rank], (name, rank, run)
        errors = [i for i, s in enumerate(steps) if isinstance(s, str)]
        if batches[rank] > AT:
            assert errors == [AT], (name, rank, run)
            if not (rank == failing and name == "acc_backward"):  # (autograd's own there)
                assert boom in steps[AT], (name, rank, run)
            assert run["left"] == "left", (name, rank, run)
        else:  # had joined: raises it as it leaves join()
            assert errors == [], (name, rank, run)
            assert run["left"].startswith("RankError") and boom in run["left"], (name, rank, run)
    _check_grads(results, world, name)


def test_a_join_context_after_them_trains(outcome: tuple[int, dict[int, Any]]) -> None:
    world, results = outcome
    for rank, result in results.items():
        run = result["after"]
        assert run["left"] == "left", (rank, run)
        assert len(run["steps"]) == _batches(world)[rank], (rank, run)
        assert all(not isinstance(s, str) for s in run["steps"]), (rank, run)
    _check_grads(results, world, "after")
