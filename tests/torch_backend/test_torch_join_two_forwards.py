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

import copy
import time
from typing import Any

import numpy as np
import pytest
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

    def run(name: str, ddps: Any, models: list[Any], ctx: Any, n: int, shape: str) -> None:
        steps: list[Any] = []
        started = time.monotonic()
        try:
            with ctx:
                for x in data[:n]:
                    for m in models:
                        m.zero_grad()
                    if shape == "separate":  # a backward pass per DDP
                        for ddp in ddps:
                            ddp(x).square().sum().backward()
                    else:
                        _loss(*ddps, x, shape).backward()
                    steps.append(_grads(models))
            left = "left"
        except RuntimeError as exc:
            left = f"{type(exc).__name__}: {exc}"
        out[name] = {"steps": steps, "left": left, "seconds": time.monotonic() - started}

    for shape in SHAPES:
        run(f"uneven_{shape}", (d1, d2), ours, Join([d1, d2]), UNEVEN[rank], shape)
        run(f"even_{shape}", (d1, d2), ours, Join([d1, d2]), EVEN[rank], shape)
        run(f"torch_even_{shape}", (t1, t2), theirs, TorchJoin([t1, t2]), EVEN[rank], shape)
    run("after", (d1, d2), ours, Join([d1, d2]), UNEVEN[rank], "separate")
    run("torch_after", (t1, t2), theirs, TorchJoin([t1, t2]), UNEVEN[rank], "separate")
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


def _same(ours: list[Any], theirs: list[Any], what: str) -> None:
    assert len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=f"{what} step {i}")


@pytest.mark.parametrize("shape", SHAPES)
def test_with_even_inputs_both_forwards_train_as_pytorchs(
    outcome: tuple[int, dict[int, Any]], shape: str
) -> None:
    _, results = outcome
    for rank, result in results.items():
        ours, theirs = result[f"even_{shape}"], result[f"torch_even_{shape}"]
        assert ours["left"] == theirs["left"] == "left", (rank, ours, theirs)
        _same(ours["steps"], theirs["steps"], f"{shape} rank {rank}")


def test_a_backward_pass_per_ddp_trains_as_pytorchs_after_it(
    outcome: tuple[int, dict[int, Any]],
) -> None:
    _, results = outcome
    for rank, result in results.items():
        ours, theirs = result["after"], result["torch_after"]
        assert ours["left"] == theirs["left"] == "left", (rank, ours, theirs)
        assert ours["seconds"] < TIMEOUT, (rank, ours)
        _same(ours["steps"], theirs["steps"], f"after rank {rank}")
