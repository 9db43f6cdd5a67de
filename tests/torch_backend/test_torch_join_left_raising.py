"""Under ``join()``, ranks still training raise a failed step out of their join block.

Gloo ranks, each scenario a join context of its own, in one run: one rank's forward pass
(or communication hook) raises once; the ranks still training catch the step's
``RankError`` and raise it again out of ``with ddp.join():``, the user catching it
outside, their processes alive (they wait at a store barrier for every rank to end the
scenario before the next). A rank that had joined must raise that failure at once,
naming the rank where it started and one that left ``join()`` raising it, and the join
contexts after it must train on every rank with ``join()``'s gradients.

* ``joined``: rank 0 has one batch, the others three; the last rank's second forward
  pass raises, rank 0 shadowing it. Rank 0 waited in that step's round to the DDP's
  timeout (3 s), since it waits past a posted failure.
* ``hook_joined``: the same with a communication hook raising instead. Rank 0 made the
  step's fresh group with ranks that never came: the group's timeout and gloo's retries
  (about 19 s), and the next context failed.
* ``late``: rank 0 has two batches: the failed step is its last, it catches the error
  and leaves ``join()`` plainly, making the fresh group before its count, for the
  others that never came.
* ``none``: every rank has three batches and raises the step out of ``join()``: no rank
  had joined, every one leaves at once.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from join_cases import all_ended, check_trained, grads, run_steps
from ranks import armed_hook, armed_linear, every_rank_ok

TIMEOUT = 3.0

#: scenario: (batches of rank 0, 1, 2, ... by world size; the rank that fails, at step 1)
SCENARIOS = {
    "joined": lambda world: [1] + [3] * (world - 1),
    "hook_joined": lambda world: [1] + [3] * (world - 1),
    "late": lambda world: [2] + [3] * (world - 1),
    "none": lambda world: [3] * world,
}
#: contexts after them, none failing: (name, batches by world size)
AFTER = {"uneven": lambda world: [1] + [2] * (world - 1), "even": lambda world: [2] * world}


#: the DDPs of this process, kept to its exit. A failed step leaves all-reduces pending on
#: the DDP's private group of some ranks; a DDP freed by the cyclic garbage collector in
#: gloo's thread as they complete (a peer exits) destroys that group there, and gloo
#: aborts the process ("Resource deadlock avoided"), whatever join() did.
_KEPT: list[Any] = []


def _contexts(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from xgrad.failure_errors import RankError
    from xgrad.torch_backend import DistributedDataParallel

    model, armed = armed_linear()
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    hook, hook_armed = armed_hook()

    hooked_model, _ = armed_linear()  # a module of its own: the same parameters
    hooked = DistributedDataParallel(hooked_model, timeout=TIMEOUT)
    hooked.register_comm_hook(None, hook)
    _KEPT.extend([ddp, hooked])
    x = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    model(x).pow(2).mean().backward()  # this rank's own gradient: the parameters never move
    out: dict[str, Any] = {"local": grads([model])}
    store = dist.distributed_c10d._get_default_store()
    plans = [(name, f(world), world - 1) for name, f in SCENARIOS.items()]
    plans += [(name, f(world), -1) for name, f in AFTER.items()]

    def step(wrapper: Any, module: Any, trigger: list[bool], failing: int, i: int) -> list[Any]:
        module.zero_grad()
        trigger[0] = rank == failing and i == 1
        wrapper(x).pow(2).mean().backward()
        return grads([module])

    for name, batches, failing in plans:
        wrapper, module = (hooked, hooked_model) if name.startswith("hook") else (ddp, model)
        trigger = hook_armed if name.startswith("hook") else armed
        out[name] = run_steps(
            wrapper.join,
            batches[rank],
            functools.partial(step, wrapper, module, trigger, failing),
            catch=(RankError,),
            reraise=rank != 0 or name == "none",
        )
        all_ended(store, f"left_raising/{name}", rank, world)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    world = request.param
    return world, every_rank_ok(_contexts, world, timeout=60)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_rank_raises_the_step_at_once(outcome: tuple[int, dict[int, Any]], name: str) -> None:
    world, results = outcome
    batches, failing = SCENARIOS[name](world), world - 1
    where = (
        "comm hook, bucket 0: ValueError: hook boom"
        if name.startswith("hook")
        else ("forward: ValueError: boom")
    )
    boom = f"rank {failing} in {where}"
    for rank, result in results.items():
        run = result[name]
        assert run["seconds"] < TIMEOUT / 2, (name, rank, run)  # never the timeout
        kind, _, message = run["left"].partition(": ")
        assert kind.startswith("RankError") and message.startswith(boom), (name, rank, run)
        if rank == 0 and name != "none":  # it stayed in join(): the note names who left
            assert "in join(): left join() raising this failure" in message, (name, rank, run)
        assert len(run["steps"]) == min(2, batches[rank]), (name, rank, run)


@pytest.mark.parametrize("name", list(AFTER))
def test_join_contexts_after_them_train(outcome: tuple[int, dict[int, Any]], name: str) -> None:
    world, results = outcome
    check_trained(results, world, name, AFTER[name](world), limit=TIMEOUT)
