"""Under ``join()``: the last backward pass of the rank that runs out of inputs first raises, and it joins.

Gloo ranks; rank 0 has two iterations, the others four (a ``try`` around each). At its
last iteration, rank 0's synchronised backward pass raises, from a hook on an
activation between two layers (after DDP's first gradient hook ran: its buckets, or its
part of the join round, are what the others wait for) or from a hook on the output
(before any of DDP's hooks: :mod:`xgrad.torch_backend.ddp_cut_short`). Rank 0 catches it,
its loop ends and it joins. Such a pass is posted at the rank's next forward pass, and a
rank that joins has none: it counted the ranks still training while they waited for its
buckets, and every later step of theirs timed out naming rank 0 (under ``ddp.join()``
and xgrad's ``Join`` of two DDPs alike). Now the joining rank posts it before it counts
(``post_cut_short`` of the join hook), and begins the next step with the others.

Checked: every rank raises the failure at iteration 1, naming rank 0 and its exception
(rank 0 its own exception); the ranks still training then train iterations 2 and 3
with ``join()``'s gradients (computed here from their inputs, divided by the world size);
an all-reduce after the context meets every rank.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from join_cases import first_line, met_by_all
from ranks import every_rank_ok

AT = 1
ITERATIONS = 4
#: scenario: (world size, where rank 0's backward raises, whether a second DDP follows)
SCENARIOS = {
    "after DDP's hooks, two ranks": (2, "between the layers", False),
    "after DDP's hooks, three ranks": (3, "between the layers", False),
    "before DDP's hooks, three ranks": (3, "on the output", False),
    "two DDPs, the second's backward": (3, "second DDP", True),
}


def _inputs(rank: int, i: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def _models(armed: list[bool]) -> tuple[Any, Any]:
    import torch
    from torch import nn

    class Between(nn.Module):
        """Identity; its output's gradient raises once when armed."""

        def forward(self, h: Any) -> Any:
            if armed[0] and h.requires_grad:
                armed[0] = False
                h = h * 1.0
                h.register_hook(_boom)
            return h

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), Between(), nn.Linear(5, 2)), nn.Linear(2, 2)


def _boom(grad: Any) -> Any:
    raise ValueError("boom on rank 0")


def _expected(world: int, i: int, two: bool) -> list[Any]:
    m1, m2 = _models([False])
    for rank in range(1 if i >= 2 else 0, world):
        x, y = _inputs(rank, i)
        (m1(x).square().mean() / world).backward()
        if two:
            (m2(y).square().mean() / world).backward()
    return [p.grad for p in (*m1.parameters(), *(m2.parameters() if two else ()))]


def _train(rank: int, world: int, where: str, two: bool) -> dict[str, Any]:
    import torch

    from xgrad.failure_errors import RankError
    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    armed = [False]
    m1, m2 = _models(armed)
    d1 = DistributedDataParallel(m1, timeout=3.0)
    d2 = DistributedDataParallel(m2, timeout=3.0) if two else None
    params = [*m1.parameters(), *(m2.parameters() if two else ())]
    raised: dict[int, str] = {}
    right: dict[int, bool] = {}
    try:
        with Join([d1, d2]) if d2 is not None else d1.join():
            for i in range(2 if rank == 0 else ITERATIONS):
                x, y = _inputs(rank, i)
                fail = rank == 0 and i == AT
                for p in params:
                    p.grad = None
                try:
                    armed[0] = fail and where == "between the layers"
                    out = d1(x)
                    if fail and where == "on the output":
                        out.register_hook(_boom)
                    out.square().mean().backward()
                    if d2 is not None:
                        out = d2(y)
                        if fail:
                            out.register_hook(_boom)
                        out.square().mean().backward()
                    right[i] = all(
                        torch.allclose(p.grad, e, atol=1e-6)
                        for p, e in zip(params, _expected(world, i, two), strict=True)
                    )
                except (RankError, ValueError) as exc:
                    raised[i] = first_line(exc)
    except RankError as exc:
        raised[-1] = first_line(exc)
    return {"raised": raised, "right": right, "total": met_by_all(rank)}


@pytest.fixture(scope="module", params=list(SCENARIOS))
def runs(request: pytest.FixtureRequest) -> tuple[str, dict[int, Any]]:
    world, where, two = SCENARIOS[request.param]
    run = functools.partial(_train, where=where, two=two)
    return request.param, every_rank_ok(run, world, timeout=120)


def test_every_rank_raises_the_failure_at_its_iteration(runs: tuple[str, dict[int, Any]]) -> None:
    name, results = runs
    assert results[0]["raised"] == {AT: "ValueError: boom on rank 0"}, (name, results[0])
    for rank in range(1, len(results)):
        raised = results[rank]["raised"]
        assert list(raised) == [AT], (name, rank, raised)
        assert "rank 0 in backward" in raised[AT] and "boom on rank 0" in raised[AT], (name, rank)


def test_the_others_train_on_with_joins_gradients(runs: tuple[str, dict[int, Any]]) -> None:
    name, results = runs
    for rank, result in results.items():
        steps = 2 if rank == 0 else ITERATIONS
        assert sorted(result["right"]) == [i for i in range(steps) if i != AT], (name, rank)
        assert all(result["right"].values()), (name, rank, result["right"])
    world = len(results)
    assert {r["total"] for r in results.values()} == {world * (world + 1) / 2}, name
