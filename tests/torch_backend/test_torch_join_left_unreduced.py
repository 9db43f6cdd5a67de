"""Under ``join()``, a step whose backward pass left buckets unreduced, raised out of ``Join``.

Gloo ranks, each scenario a join context of its own, in one run: one rank's backward
pass leaves a layer without a gradient (no ``find_unused_parameters``) once, so its
reduction never completes; every rank still training raises the step's error at its
next forward pass (PyTorch's "Expected to have finished reduction in the prior
iteration" on that rank, the posted failure naming it elsewhere) and raises it again out
of ``with ddp.join():``, the user catching it outside, the process alive (each waits at a
store barrier for every rank to end the scenario). A rank that had joined must raise
that failure at once, naming the rank where it started and one that left ``join()``
raising it, and the join contexts after it must train with ``join()``'s gradients.

* ``joined``: rank 0 has one batch, the others three; the last rank's second backward
  pass leaves the layer out. The forward pass where the ranks still training raise it
  begins the next step, before their count: rank 0 made that step's fresh group with
  them, then waited in its count to the DDP's timeout (3 s).
* ``late``: rank 0 has two batches: the failed step is its last. Its count drops the
  step and waited the same way.
* ``none``: every rank has three batches and raises the step out of ``join()``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from join_cases import all_ended, check_trained, run_steps
from ranks import every_rank_ok

TIMEOUT = 3.0

#: scenario: batches of rank 0, 1, 2, ... by world size (the last rank fails at step 1)
SCENARIOS = {
    "joined": lambda world: [1] + [3] * (world - 1),
    "late": lambda world: [2] + [3] * (world - 1),
    "none": lambda world: [3] * world,
}
#: contexts after them, none failing: (name, batches by world size)
AFTER = {"uneven": lambda world: [1] + [2] * (world - 1), "even": lambda world: [2] * world}

#: the DDPs of this process, kept to its exit (see test_torch_join_left_raising).
_KEPT: list[Any] = []


def _model() -> tuple[Any, list[bool]]:
    """Two layers (seed 0); the second is left out of the forward pass once each time
    ``skip[0]`` is set to ``True``."""
    import torch
    from torch import nn

    class TwoLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.c = nn.Linear(4, 2)
            self.skip = [False]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if self.skip[0]:
                self.skip[0] = False
                return h[:, :2]
            return self.c(h)

    torch.manual_seed(0)
    model = TwoLayers()
    return model, model.skip


def _grads(module: Any) -> list[Any]:
    return [None if p.grad is None else p.grad.clone().numpy() for p in module.parameters()]


def _contexts(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    model, skip = _model()
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    _KEPT.append(ddp)
    x = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    model(x).pow(2).mean().backward()  # this rank's own gradient: the parameters never move
    out: dict[str, Any] = {"local": _grads(model)}
    store = dist.distributed_c10d._get_default_store()
    plans = [(name, f(world), world - 1) for name, f in SCENARIOS.items()]
    plans += [(name, f(world), -1) for name, f in AFTER.items()]

    def step(failing: int, i: int) -> list[Any]:
        model.zero_grad()
        skip[0] = rank == failing and i == 1
        ddp(x).pow(2).mean().backward()
        return _grads(model)

    for name, batches, failing in plans:
        out[name] = run_steps(
            ddp.join,
            batches[rank],
            functools.partial(step, failing),
            catch=(RuntimeError,),
            reraise=True,
        )
        all_ended(store, f"left_unreduced/{name}", rank, world)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    world = request.param
    return world, every_rank_ok(_contexts, world, timeout=60)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_rank_raises_the_step_at_once(outcome: tuple[int, dict[int, Any]], name: str) -> None:
    world, results = outcome
    batches, failing = SCENARIOS[name](world), world - 1
    boom = f"rank {failing} in backward (parameters without a gradient): RuntimeError: "
    for rank, result in results.items():
        run = result[name]
        assert run["seconds"] < TIMEOUT / 2, (name, rank, run)  # never the timeout
        kind, _, message = run["left"].partition(": ")
        if rank == failing:  # PyTorch's words, naming it
            assert message.startswith("Expected to have finished reduction"), (name, rank, run)
            assert f"did not receive grad for rank {failing}" in message, (name, rank, run)
        else:
            assert kind.startswith("RankError") and message.startswith(boom), (name, rank, run)
        if rank == 0 and name != "none":  # it had joined: the note names who left
            assert "in join(): left join() raising this failure" in message, (name, rank, run)
            assert len(run["steps"]) == batches[0], (name, rank, run)
        else:  # raised at the forward pass after the failed step
            assert len(run["steps"]) == 3 and run["steps"][2] == run["left"], (name, rank, run)


@pytest.mark.parametrize("name", list(AFTER))
def test_join_contexts_after_them_train(outcome: tuple[int, dict[int, Any]], name: str) -> None:
    world, results = outcome
    check_trained(results, world, name, AFTER[name](world), limit=TIMEOUT)
