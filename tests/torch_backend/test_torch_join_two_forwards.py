"""Two DDPs in one xgrad ``Join``, both forward passes before one backward pass.

``d2(d1(x)).backward()`` (``chain``), or ``(d1(x).square().sum() + d2(x).square().sum())
.backward()`` (``sum``), in ``Join([d1, d2])``, gloo ranks. With uneven inputs (rank 0 has
one batch, the others three) the joined rank waited in DDP 0's round, which the others
enter in the backward pass, while they waited in DDP 1's forward pass for its part of the
announcement: every rank timed out (3 s). PyTorch's ``Join([d1, d2])`` over its own DDPs
hangs there too, to gloo's timeout (tried by hand: its joined rank pairs DDP 0's buckets
with DDP 1's forward pass on one group), so no exact answer is asked for: every rank must
raise at once, naming the situation, and a join context with a backward pass per DDP
after it must train as PyTorch's does. With even inputs nobody joins: the passes go as
outside ``join()``, with PyTorch's gradients (its ``Join`` works there).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from join_cases import check_as_pytorch, grads, run_steps, two_linear_ddps
from ranks import every_rank_ok

TIMEOUT = 3.0
SHAPES = ("chain", "sum")
#: batches per rank: uneven (rank 0 joins after one) and even
UNEVEN = (1, 3, 3)
EVEN = (2, 2, 2)


def _loss(d1: Any, d2: Any, x: Any, shape: str) -> Any:
    if shape == "chain":
        return d2(d1(x)).square().sum()
    return d1(x).square().sum() + d2(x).square().sum()


def _contexts(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.algorithms.join import Join as TorchJoin

    from xgrad.torch_backend.join import Join

    data, (ours, d1, d2), (theirs, t1, t2) = two_linear_ddps(rank, TIMEOUT)
    out: dict[str, Any] = {}

    def step(ddps: Any, models: list[Any], shape: str, i: int) -> list[Any]:
        for m in models:
            m.zero_grad()
        if shape == "separate":  # a backward pass per DDP
            for ddp in ddps:
                ddp(data[i]).square().sum().backward()
        else:
            _loss(*ddps, data[i], shape).backward()
        return grads(models)

    def run(name: str, ddps: Any, models: list[Any], ctx: Any, n: int, shape: str) -> None:
        # (nothing caught: an error leaves the context)
        out[name] = run_steps(ctx, n, functools.partial(step, ddps, models, shape), catch=())

    ours_join = functools.partial(Join, [d1, d2])
    theirs_join = functools.partial(TorchJoin, [t1, t2])
    for shape in SHAPES:
        run(f"uneven_{shape}", (d1, d2), ours, ours_join, UNEVEN[rank], shape)
        run(f"even_{shape}", (d1, d2), ours, ours_join, EVEN[rank], shape)
        run(f"torch_even_{shape}", (t1, t2), theirs, theirs_join, EVEN[rank], shape)
    run("after", (d1, d2), ours, ours_join, UNEVEN[rank], "separate")
    run("torch_after", (t1, t2), theirs, theirs_join, UNEVEN[rank], "separate")
    return out


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    world = request.param
    return world, every_rank_ok(_contexts, world, timeout=60)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_rank_raises_at_once_naming_it(
    outcome: tuple[int, dict[int, Any]], shape: str
) -> None:
    world, results = outcome
    words = "cannot shadow two forward passes before one backward"
    for rank, result in results.items():
        run = result[f"uneven_{shape}"]
        assert run["seconds"] < TIMEOUT / 2, (shape, rank, run)  # never the timeout
        assert words in run["left"], (shape, rank, run)
        if rank == 0:  # joined: the error of a rank still training, named
            assert run["left"].startswith("RankError: rank "), (shape, rank, run)
            assert int(run["left"].split()[2]) in range(1, world), (shape, rank, run)
            assert len(run["steps"]) == 1, (shape, rank, run)
        else:
            assert run["left"].startswith(f"RuntimeError: join(): rank {rank} ran"), run
            assert len(run["steps"]) == 1, (shape, rank, run)  # the step all trained


@pytest.mark.parametrize("shape", SHAPES)
def test_with_even_inputs_both_forwards_train_as_pytorchs(
    outcome: tuple[int, dict[int, Any]], shape: str
) -> None:
    check_as_pytorch(outcome[1], f"even_{shape}", f"torch_even_{shape}")


def test_a_backward_pass_per_ddp_trains_as_pytorchs_after_it(
    outcome: tuple[int, dict[int, Any]],
) -> None:
    check_as_pytorch(outcome[1], "after", "torch_after", limit=TIMEOUT)
