"""Under ``join()``, a step that fails while some rank has joined, or on a rank's last batch.

Gloo ranks, each scenario a join context of its own, in one run: a forward pass raises
once (``ValueError("boom")``) on one rank, which catches it and goes on, as the others
do; every rank that ran the step raises its ``RankError`` naming that rank there, and a
rank that had joined raises it as it leaves ``join()``. The steps after it, and an even
join context after them all, train with ``join()``'s gradients, none waiting out a timeout.

* ``joined``: rank 0 has one batch, the others three; the last rank's second forward
  pass raises, rank 0 shadowing it. Rank 0 raised the failure at once and left
  ``join()``; the others then waited for it in the DDP's new process group until they
  raised "Wait timeout", naming rank 0 as "stopped answering", at every later step.
* ``eval``: the same, each rank still training running a ``torch.no_grad()`` pass right
  after the failed step (the first pass after it, which begins the next step under join).
* ``torch_join``: ``joined`` under PyTorch's own ``Join([ddp])``.
* ``last``: rank 1 has two batches, the others three; rank 1's forward pass raises on its
  last batch, and it leaves ``join()`` right after. It raised a spurious "left join()
  after a forward pass with gradients on and no backward pass", and the others timed out.
* ``hook_joined``, ``hook_last``: ``joined`` and ``last`` with a backward pass that fails
  instead (a communication hook that raises, ``ValueError("hook boom")``), on a DDP of
  its own.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from join_cases import check_grads, check_trained, grads, run_steps
from ranks import armed_hook, armed_linear, every_rank_ok

TIMEOUT = 3.0

#: scenario: (batches of rank 0, 1, 2, ...: a function of the world size, the failing
#: rank, the step whose forward pass raises there)
SCENARIOS = {
    "joined": (lambda world: [1] + [3] * (world - 1), lambda world: world - 1, 1),
    "eval": (lambda world: [1] + [3] * (world - 1), lambda world: world - 1, 1),
    "torch_join": (lambda world: [1] + [3] * (world - 1), lambda world: world - 1, 1),
    "last": (lambda world: [3, 2] + [3] * (world - 2), lambda world: 1, 1),
    "hook_joined": (lambda world: [1] + [3] * (world - 1), lambda world: world - 1, 1),
    "hook_last": (lambda world: [3, 2] + [3] * (world - 2), lambda world: 1, 1),
}
#: what the failing rank's failure is named as, by scenario
WHERE = {
    "hook_joined": "comm hook, bucket 0: ValueError: hook boom",
    "hook_last": "comm hook, bucket 0: ValueError: hook boom",
}


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.algorithms.join import Join as TorchJoin

    from xgrad.failure_errors import RankError
    from xgrad.torch_backend import DistributedDataParallel

    model, armed = armed_linear()
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    x = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    model(x).pow(2).mean().backward()  # this rank's own gradient: the parameters never move
    out: dict[str, Any] = {"local": grads([model])}
    hooked, hook_armed = _hooked_ddp(model)
    plans = [
        (name, *(f(world) if callable(f) else f for f in spec)) for name, spec in SCENARIOS.items()
    ]

    def step(wrapper: Any, trigger: list[bool], failing: int, at: int, i: int) -> list[Any]:
        model.zero_grad()
        trigger[0] = rank == failing and i == at
        wrapper(x).pow(2).mean().backward()
        return grads([model])

    def evaluate() -> None:  # a pass right after the failed step, in ``eval``
        with torch.no_grad():
            ddp(x)

    for name, batches, failing, at in [*plans, ("even", [2] * world, -1, -1)]:
        wrapper = hooked if name.startswith("hook") else ddp
        trigger = hook_armed if name.startswith("hook") else armed
        context = functools.partial(TorchJoin, [ddp]) if name == "torch_join" else wrapper.join
        out[name] = run_steps(
            context,
            batches[rank],
            functools.partial(step, wrapper, trigger, failing, at),
            catch=(RankError,),  # the failed step's; any other error leaves join()
            on_error=evaluate if name == "eval" else None,
        )
    return out


def _hooked_ddp(model: Any) -> tuple[Any, list[bool]]:
    """A second DDP of ``model`` whose communication hook raises once each time
    ``armed[0]`` is set to ``True`` (else PyTorch's all-reduce hook)."""
    from xgrad.torch_backend import DistributedDataParallel

    hook, armed = armed_hook()
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    ddp.register_comm_hook(None, hook)
    return ddp, armed


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    world = request.param
    return world, every_rank_ok(_scenarios, world, timeout=90)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_rank_raises_the_failed_step_and_later_steps_train(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    batches_of, failing_of, at = SCENARIOS[name]
    batches, failing = batches_of(world), failing_of(world)
    boom = f"rank {failing} in {WHERE.get(name, 'forward: ValueError: boom')}"

    def names_it(text: Any) -> bool:  # a RankError (of ValueError on the failing rank)
        kind, _, message = str(text).partition(": ")
        return kind.startswith("RankError") and message.startswith(boom)

    for rank, result in results.items():
        run = result[name]
        steps = run["steps"]
        assert len(steps) == batches[rank], (name, rank, run)
        if batches[rank] > at:  # ran the failed step: raised it there, and left plainly
            assert isinstance(steps[at], str) and names_it(steps[at]), (name, rank, run)
            assert run["left"] == "left", (name, rank, run)
        else:  # had joined: raises it as it leaves join()
            assert names_it(run["left"]), (name, rank, run)
        others = [s for i, s in enumerate(steps) if i != at]
        assert all(not isinstance(s, str) for s in others), (name, rank, run)
        assert run["seconds"] < TIMEOUT, (name, rank, run)  # no one waited out a timeout
    check_grads(results, world, name, batches)


def test_an_even_join_context_after_them_trains(outcome: tuple[int, dict[int, Any]]) -> None:
    world, results = outcome
    check_trained(results, world, "even", [2] * world)
