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

import functools
from typing import Any

import pytest
from join_cases import (
    check_grads,
    check_raised_once,
    check_trained,
    grads,
    run_steps,
    two_passes,
)
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
    out: dict[str, Any] = {"local": grads([model])}

    def loss(pass_: str, name: str, failing: bool) -> Any:
        trip["forward"] = failing and name.replace("_even", "_forward") == f"{pass_}_forward"
        hook_armed[0] = failing and name == f"{pass_}_hook"
        trip["backward"] = failing and name == f"{pass_}_backward"
        return ddp(x).pow(2).mean()

    def step(name: str, i: int) -> list[Any]:
        model.zero_grad()
        failing = rank == world - 1 and i == AT
        with ddp.no_sync():
            loss("acc", name, failing).backward()
        loss("sync", name, failing).backward()
        return grads([model])

    for name in [*WHERE, "after"]:
        count = _batches(world, name)[rank]
        out[name] = run_steps(ddp.join, count, functools.partial(step, name))
    return out


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    world = request.param
    return world, every_rank_ok(_contexts, world, timeout=90)


@pytest.mark.parametrize("name", list(WHERE))
def test_every_rank_raises_the_step_once_and_the_steps_after_it_train(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    batches, failing = _batches(world, name), world - 1
    boom = f"rank {failing} in {WHERE[name]}"
    for rank, result in results.items():
        # (the failing rank's backward raises autograd's own error there)
        named = not (rank == failing and name == "acc_backward")
        label = (name, rank)
        check_raised_once(
            result[name], batches[rank], AT, boom, label, limit=TIMEOUT / 2, named=named
        )
    check_grads(results, world, name, batches, passes=two_passes)


def test_a_join_context_after_them_trains(outcome: tuple[int, dict[int, Any]]) -> None:
    world, results = outcome
    check_trained(results, world, "after", _batches(world), passes=two_passes)
