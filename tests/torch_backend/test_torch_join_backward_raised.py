"""Under ``join()``, two failures in one step: a forward pass and a backward pass that raise.

Gloo ranks, each scenario a join context of its own, in one run: at step 1 one rank's
backward pass raises (a hook on an activation, ``ValueError("grad boom")``) once the
DDP's first gradient hook has run, so its join round is entered (``GO``) and read late,
by the pass's first wait for a bucket, which never comes
(:mod:`xgrad.torch_backend.join_rounds`); another rank's forward pass raises
(``ValueError("boom")``), which enters that round only at its next forward pass
(``FAIL``). The users catch the errors and go on. Every rank that ran the step must
raise it there once, every later step must train with ``join()``'s gradients, a rank
that had joined raises the step's failure as it leaves ``join()``, and a join context
after them trains.

* ``one``: rank 0 has one batch, the others three; the last rank's backward raises.
* ``two_joined``: the same, and rank 1's forward pass raises too (at three ranks).
* ``two_even``: every rank has three batches; rank 0's forward and the last rank's
  backward raise.
* ``two_late``: the same with rank 0 at its last batch (two), which then joins.

Before, the rank whose backward raised read its round at its next forward pass, found
the forward pass's failure posted and the round not complete, and raised that failure
there: a second error for one step, and that pass began no step, so the rank was a step
behind the others from there on (its later steps paired with the peers' next ones, to
the end of ``join()``).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from join_cases import check_grads, check_trained, grads, run_steps
from ranks import every_rank_ok

TIMEOUT = 3.0

#: scenario, by world size: (batches of rank 0, 1, ...; the rank whose forward pass
#: raises at step 1, or -1; the rank whose backward pass raises there)
SCENARIOS = {
    "one": lambda world: ([1] + [3] * (world - 1), -1, world - 1),
    "two_joined": lambda world: ([1] + [3] * (world - 1), 1 if world > 2 else -1, world - 1),
    "two_even": lambda world: ([3] * world, 0, world - 1),
    "two_late": lambda world: ([2] + [3] * (world - 1), 0, world - 1),
}
AT = 1


def _model() -> tuple[Any, list[bool], list[bool]]:
    """Two layers (seed 0); the forward pass raises once each time ``forward[0]`` is set
    to ``True``; the first layer's output raises in the backward pass (after the second
    layer's gradients, so after the DDP's first gradient hook) once each time
    ``armed[0]`` is."""
    import torch
    from torch import nn

    armed = [False]
    forward = [False]

    class TwoLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.c = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if forward[0]:
                forward[0] = False
                raise ValueError("boom")
            h = self.a(x)
            if armed[0]:
                armed[0] = False

                def boom(grad: torch.Tensor) -> None:
                    raise ValueError("grad boom")

                h.register_hook(boom)
            return self.c(h)

    torch.manual_seed(0)
    return TwoLayers(), armed, forward


def _contexts(rank: int, world: int) -> dict[str, Any]:
    import torch

    from xgrad.torch_backend import DistributedDataParallel

    model, armed, forward = _model()
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    x = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    model(x).pow(2).mean().backward()  # this rank's own gradient: the parameters never move
    out: dict[str, Any] = {"local": grads([model])}

    def step(in_forward: int, in_backward: int, i: int) -> list[Any]:
        model.zero_grad()
        forward[0] = rank == in_forward and i == AT
        armed[0] = rank == in_backward and i == AT
        ddp(x).pow(2).mean().backward()
        return grads([model])

    plans = [(name, *f(world)) for name, f in SCENARIOS.items()]
    for name, batches, in_forward, in_backward in [
        *plans,
        ("after", [1] + [2] * (world - 1), -1, -1),
    ]:
        out[name] = run_steps(
            ddp.join,
            batches[rank],
            functools.partial(step, in_forward, in_backward),
            catch=(RuntimeError, ValueError),
        )
    return out


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    world = request.param
    return world, every_rank_ok(_contexts, world, timeout=60)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_step_raises_once_and_the_steps_after_it_train(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    batches, in_forward, in_backward = SCENARIOS[name](world)
    failing = [r for r in (in_forward, in_backward) if r >= 0]
    for rank, result in results.items():
        run = result[name]
        steps = run["steps"]
        assert run["seconds"] < TIMEOUT, (name, rank, run)  # no one waited out a timeout
        assert len(steps) == batches[rank], (name, rank, run)
        errors = [i for i, s in enumerate(steps) if isinstance(s, str)]
        if batches[rank] > AT:  # ran the failed step: raised there, once, and left plainly
            assert errors == [AT], (name, rank, run)
            if rank == in_backward:  # its own exception (autograd's, as outside DDP)
                assert steps[AT] == "ValueError: grad boom", (name, rank, run)
            elif rank == in_forward:  # its own, posted: the peers raise it
                assert steps[AT].startswith("RankError"), (name, rank, run)
                assert f"rank {rank} in forward: ValueError: boom" in steps[AT], (name, rank, run)
            else:
                assert steps[AT].startswith("RankError: rank "), (name, rank, run)
                assert int(steps[AT].split()[2].rstrip(":")) in failing, (name, rank, run)
            assert run["left"] == "left", (name, rank, run)
        else:  # had joined: raises it as it leaves join(), naming a failing rank
            assert errors == [], (name, rank, run)
            assert run["left"].startswith("RankError: rank "), (name, rank, run)
            assert int(run["left"].split()[2]) in failing, (name, rank, run)
    check_grads(results, world, name, batches)


def test_a_join_context_after_them_trains(outcome: tuple[int, dict[int, Any]]) -> None:
    world, results = outcome
    check_trained(results, world, "after", [1] + [2] * (world - 1))
