"""Two DDPs in one xgrad ``Join`` listed in another order than their forward passes run.

``Join([d2, d1])`` where each iteration runs ``d1``'s forward and backward passes, then
``d2``'s, gloo ranks. A rank that has joined shadows the DDPs in the context's order,
the first joinable first (its forward pass is the one that counts the ranks still
training): it counted, waiting for ``d2``'s forward pass, while the ranks still training
waited for it in ``d1``'s: every rank timed out (3 s). PyTorch's ``Join([t2, t1])`` over
its own DDPs hangs there too, to gloo's timeout (tried by hand: both ranks raise gloo's
"Timed out waiting ... for recv" after 5 s, the process group's timeout). So no exact
answer is asked for once a rank has joined: every rank must raise at once, naming the
DDPs and the way out, and a join context after it must train as PyTorch's does. With
even inputs nobody joins: the passes go as PyTorch's (its ``Join`` works there).

* ``uneven``: rank 0 has one batch, the others three.
* ``none_left``: rank 0 has no batch at all (it never ran a forward pass in the context).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import pytest
from ranks import every_rank_ok

TIMEOUT = 3.0
#: batches per rank, by world size
UNEVEN = {
    "uneven": lambda world: [1] + [3] * (world - 1),
    "none_left": lambda w: [0] + [3] * (w - 1),
}
EVEN = (2, 2, 2)


def _grads(models: list[Any]) -> list[Any]:
    return [p.grad.clone().numpy() for m in models for p in m.parameters()]


def _contexts(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    torch.manual_seed(0)
    base = [nn.Linear(5, 5), nn.Linear(5, 2)]
    g = torch.Generator().manual_seed(10 + rank)
    data = [torch.randn(4, 5, generator=g) for _ in range(3)]
    ours = [copy.deepcopy(m) for m in base]
    d1, d2 = (DistributedDataParallel(m, timeout=TIMEOUT) for m in ours)
    theirs = [copy.deepcopy(m) for m in base]
    t1, t2 = (TorchDDP(m) for m in theirs)
    out: dict[str, Any] = {}

    def run(name: str, ddps: Any, models: list[Any], ctx: Any, n: int) -> None:
        steps: list[Any] = []
        started = time.monotonic()
        try:
            with ctx:
                for x in data[:n]:
                    for m in models:
                        m.zero_grad()
                    for ddp in ddps:  # d1 first, then d2: a backward pass each
                        ddp(x).square().sum().backward()
                    steps.append(_grads(models))
            left = "left"
        except RuntimeError as exc:
            left = f"{type(exc).__name__}: {exc}"
        out[name] = {"steps": steps, "left": left, "seconds": time.monotonic() - started}

    for name, batches in UNEVEN.items():
        run(name, (d1, d2), ours, Join([d2, d1]), batches(world)[rank])
    run("even", (d1, d2), ours, Join([d2, d1]), EVEN[rank])
    run("torch_even", (t1, t2), theirs, TorchJoin([t2, t1]), EVEN[rank])
    after = UNEVEN["uneven"](world)[rank]
    run("after", (d1, d2), ours, Join([d1, d2]), after)
    run("torch_after", (t1, t2), theirs, TorchJoin([t1, t2]), after)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    world = request.param
    return world, every_rank_ok(_contexts, world, timeout=60)


@pytest.mark.parametrize("name", list(UNEVEN))
def test_every_rank_raises_at_once_naming_it(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    batches = UNEVEN[name](world)
    words = "ran DDP 1's forward pass before DDP 0's"
    for rank, result in results.items():
        run = result[name]
        assert run["seconds"] < TIMEOUT / 2, (name, rank, run)  # never the timeout
        assert words in run["left"] and "Join([d1, d2])" in run["left"], (name, rank, run)
        assert run["left"].startswith("RankError: rank 0 in join"), (name, rank, run)
        assert len(run["steps"]) == batches[0], (name, rank, run)  # the steps all trained


def _same(ours: list[Any], theirs: list[Any], what: str) -> None:
    assert len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=f"{what} step {i}")


def test_with_even_inputs_they_train_as_pytorchs(outcome: tuple[int, dict[int, Any]]) -> None:
    _, results = outcome
    for rank, result in results.items():
        ours, theirs = result["even"], result["torch_even"]
        assert ours["left"] == theirs["left"] == "left", (rank, ours, theirs)
        _same(ours["steps"], theirs["steps"], f"even rank {rank}")


def test_a_join_context_in_their_order_trains_as_pytorchs_after_it(
    outcome: tuple[int, dict[int, Any]],
) -> None:
    _, results = outcome
    for rank, result in results.items():
        ours, theirs = result["after"], result["torch_after"]
        assert ours["left"] == theirs["left"] == "left", (rank, ours, theirs)
        assert ours["seconds"] < TIMEOUT, (rank, ours)
        _same(ours["steps"], theirs["steps"], f"after rank {rank}")
