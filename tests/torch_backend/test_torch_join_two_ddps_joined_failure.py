"""Two DDPs in xgrad's ``Join``, only the first accumulating, a step failing as a rank has just joined.

Three gloo ranks; rank 0 has two iterations, the others five. Each iteration runs ``d1``
under ``no_sync``, then synchronised, then ``d2`` once (a ``try`` around the iteration).
At iteration 2, as rank 0 joins, one of the other ranks fails in ``d1``'s ``no_sync``
forward or backward pass, or in ``d2``'s forward or backward pass; or at iteration 3 in
``d1``'s synchronised backward pass (each backward from a hook on the output, before any
of DDP's hooks). Rank 0's hooks then shadow ``d2`` after
each count of ``d1``: the ranks still training stand in for ``d2`` where they run none
(:mod:`xgrad.torch_backend.join_absent`). Before, each of these broke ``join()``:

* a ``no_sync`` pass of ``d1`` that failed: the failing rank stood in for ``d2`` as for a
  ``no_sync`` pass, and the other rank still training stood in as for an evaluation, or
  not at all, as it had heard of the failure or not (a race): "the ranks still training
  ran different forward passes" on every rank, or gloo aborting rank 0 on a collective
  of the wrong size and the others timing out at every later iteration;
* a pass of ``d2`` that failed: the ranks still training stood in for ``d2``'s next pass
  on its failed group, while rank 0 waited for them to make its fresh one: gloo aborted
  one rank, and every later iteration of the others raised the failure again;
* ``d1``'s synchronised backward pass: the failing rank stood in for ``d2`` at its next
  pass of ``d1``, before posting the failure, and waited there while the others waited
  for its part of ``d1``'s round: the round timed out, then every iteration after.

Checked: every rank raises at that iteration (rank 0 as it leaves ``join()``), naming the
failing rank and its exception; every other iteration's gradients are those of its own
inputs on the ranks still training (computed here, divided by the world size as
``join()``'s default divides them); an all-reduce after the context meets every rank.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from join_cases import first_line, met_by_all
from ranks import every_rank_ok

WORLD = 3
ITERATIONS = (2, 5, 5)
#: scenario: (the pass that raises, the rank it raises on, the iteration)
SCENARIOS = {
    "d1 no_sync forward": ("no_sync forward", 1, 2),
    "d1 no_sync backward": ("no_sync backward", 2, 2),
    "d2 forward": ("d2 forward", 1, 2),
    "d2 backward": ("d2 backward", 2, 2),
    "d1 backward, an iteration later": ("backward", 1, 3),
}


def _inputs(rank: int, i: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(3, 4, generator=g), torch.randn(3, 6, generator=g)


def _models() -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Linear(4, 6), nn.Linear(6, 2)


def _expected(i: int) -> list[Any]:
    """Iteration ``i``'s gradients: each training rank's ``d1`` input twice and ``d2``
    input once, divided by the world size."""
    m1, m2 = _models()
    for rank in range(WORLD):
        if i < ITERATIONS[rank]:
            x, y = _inputs(rank, i)
            (2 * m1(x).square().mean() / WORLD).backward()
            (m2(y).square().mean() / WORLD).backward()
    return [p.grad for p in (*m1.parameters(), *m2.parameters())]


def _train(rank: int, world: int, point: str, failing: int, at: int) -> dict[str, Any]:
    import torch

    from xgrad.failure_errors import RankError
    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    m1, m2 = _models()
    armed = [""]

    def forward_boom(name: str) -> Any:
        def hook(module: Any, inputs: Any) -> None:
            if armed[0] == name:
                armed[0] = ""
                raise ValueError(f"boom on rank {rank}")

        return hook

    def boom(grad: Any) -> Any:
        raise ValueError(f"boom on rank {rank}")

    m1.register_forward_pre_hook(forward_boom("no_sync forward"))
    m2.register_forward_pre_hook(forward_boom("d2 forward"))
    d1, d2 = DistributedDataParallel(m1, timeout=3.0), DistributedDataParallel(m2, timeout=3.0)

    def backward(out: Any, name: str) -> None:
        if name and armed[0] == name:
            armed[0] = ""
            out.register_hook(boom)
        out.square().mean().backward()

    raised: dict[int, str] = {}
    right: dict[int, bool] = {}
    try:
        with Join([d1, d2]):
            for i in range(ITERATIONS[rank]):
                x, y = _inputs(rank, i)
                armed[0] = point if i == at and rank == failing else ""
                for p in (*m1.parameters(), *m2.parameters()):
                    p.grad = None
                try:
                    with d1.no_sync():
                        backward(d1(x), "no_sync backward")
                    backward(d1(x), "backward")
                    backward(d2(y), "d2 backward")
                    got = [p.grad for p in (*m1.parameters(), *m2.parameters())]
                    right[i] = all(
                        torch.allclose(a, b, atol=1e-6)
                        for a, b in zip(got, _expected(i), strict=True)
                    )
                except (RankError, ValueError) as exc:
                    raised[i] = first_line(exc)
    except RankError as exc:  # the joined rank: the failure, as it leaves
        raised[-1] = first_line(exc)
    return {"raised": raised, "right": right, "total": met_by_all(rank)}


@pytest.fixture(scope="module", params=list(SCENARIOS))
def runs(request: pytest.FixtureRequest) -> tuple[str, dict[int, Any]]:
    point, failing, at = SCENARIOS[request.param]
    run = functools.partial(_train, point=point, failing=failing, at=at)
    return request.param, every_rank_ok(run, WORLD, timeout=120)


def test_every_rank_raises_the_failure_once(runs: tuple[str, dict[int, Any]]) -> None:
    name, results = runs
    _, failing, when = SCENARIOS[name]
    for rank, result in results.items():
        raised = result["raised"]
        at = -1 if rank == 0 else when
        assert list(raised) == [at], (name, rank, raised)
        assert f"boom on rank {failing}" in raised[at], (name, rank, raised)
        if rank != failing or "forward" in name:  # (a backward pass: its own exception)
            assert f"rank {failing} in " in raised[at], (name, rank, raised)


def test_every_other_iteration_has_its_own_gradients(runs: tuple[str, dict[int, Any]]) -> None:
    name, results = runs
    at = SCENARIOS[name][2]
    for rank, result in results.items():
        right = result["right"]
        assert sorted(right) == [i for i in range(ITERATIONS[rank]) if i != at], (name, rank)
        assert all(right.values()), (name, rank, right)


def test_no_collective_is_left_unpaired(runs: tuple[str, dict[int, Any]]) -> None:
    name, results = runs
    assert {r["total"] for r in results.values()} == {WORLD * (WORLD + 1) / 2}, name
