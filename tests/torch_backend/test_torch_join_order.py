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

import functools
from typing import Any

import pytest
from join_cases import check_as_pytorch, grads, run_steps, two_linear_ddps
from ranks import every_rank_ok

TIMEOUT = 3.0
#: batches per rank, by world size
UNEVEN = {
    "uneven": lambda world: [1] + [3] * (world - 1),
    "none_left": lambda w: [0] + [3] * (w - 1),
}
EVEN = (2, 2, 2)


def _contexts(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.algorithms.join import Join as TorchJoin

    from xgrad.torch_backend.join import Join

    data, (ours, d1, d2), (theirs, t1, t2) = two_linear_ddps(rank, TIMEOUT)
    out: dict[str, Any] = {}

    def step(ddps: Any, models: list[Any], i: int) -> list[Any]:
        for m in models:
            m.zero_grad()
        for ddp in ddps:  # d1 first, then d2: a backward pass each
            ddp(data[i]).square().sum().backward()
        return grads(models)

    def run(name: str, ddps: Any, models: list[Any], ctx: Any, n: int) -> None:
        # (nothing caught: an error leaves the context)
        out[name] = run_steps(ctx, n, functools.partial(step, ddps, models), catch=())

    for name, batches in UNEVEN.items():
        run(name, (d1, d2), ours, functools.partial(Join, [d2, d1]), batches(world)[rank])
    run("even", (d1, d2), ours, functools.partial(Join, [d2, d1]), EVEN[rank])
    run("torch_even", (t1, t2), theirs, functools.partial(TorchJoin, [t2, t1]), EVEN[rank])
    after = UNEVEN["uneven"](world)[rank]
    run("after", (d1, d2), ours, functools.partial(Join, [d1, d2]), after)
    run("torch_after", (t1, t2), theirs, functools.partial(TorchJoin, [t1, t2]), after)
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


def test_with_even_inputs_they_train_as_pytorchs(outcome: tuple[int, dict[int, Any]]) -> None:
    check_as_pytorch(outcome[1], "even", "torch_even")


def test_a_join_context_in_their_order_trains_as_pytorchs_after_it(
    outcome: tuple[int, dict[int, Any]],
) -> None:
    check_as_pytorch(outcome[1], "after", "torch_after", limit=TIMEOUT)
