"""Two DDPs in xgrad's ``Join``, only the first accumulating, an iteration given up in its ``no_sync`` pass.

Each iteration runs ``d1`` under ``no_sync`` then synchronised, then ``d2`` once
(synchronised: it accumulates nothing), a ``try`` around the iteration; at iteration 2
the last rank's ``d1`` ``no_sync`` forward pass raises. The failing rank gives up the
iteration (:mod:`xgrad.torch_backend.join_given_up`), and stood in for ``d2``'s pass of
that micro-batch as if ``d2`` accumulated too: with no rank joined the others run no
``d2`` pass there, and their next real one, an iteration later, met the stand-in: at
three ranks with even inputs every rank raised "the ranks still training ran different
forward passes" out of ``join()``. Now a DDP whose last step had no ``no_sync`` pass is
not stood in for there; where a rank has joined (whose cycle the ranks still training
stand in for, :mod:`xgrad.torch_backend.join_absent`), every rank still training stands
in for it alike at its next pass of the first DDP, the failing rank too
(``test_torch_join_two_ddps_joined_failure.py`` has three ranks there).

Checked: every rank that ran iteration 2 raises the failure there, once, naming the
failing rank; a rank that had joined raises it as it leaves ``join()``; the other
iterations train (the parameters stay the same on every rank); and an all-reduce on the
default group after the context meets every rank (no collective left unpaired).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from join_cases import met_by_all
from ranks import every_rank_ok

AT = 2
CASES = {"even, three ranks": (3, (4, 4, 4)), "uneven, two ranks": (2, (2, 4))}


def _train(rank: int, world: int, batches: tuple[int, ...]) -> dict[str, Any]:
    import torch
    from torch import nn

    from xgrad.failure_errors import RankError
    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    torch.manual_seed(0)
    m1, m2 = nn.Linear(4, 6), nn.Linear(6, 2)
    armed = [False]

    def boom(module: Any, inputs: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise ValueError("boom")

    m1.register_forward_pre_hook(boom)
    d1, d2 = DistributedDataParallel(m1, timeout=3.0), DistributedDataParallel(m2, timeout=3.0)
    opt = torch.optim.SGD([*m1.parameters(), *m2.parameters()], lr=0.1)
    g = torch.Generator().manual_seed(rank)
    raised: list[tuple[int, str]] = []
    try:
        with Join([d1, d2]):
            for i in range(batches[rank]):
                x, y = torch.randn(3, 4, generator=g), torch.randn(3, 6, generator=g)
                try:
                    opt.zero_grad()
                    with d1.no_sync():
                        armed[0] = i == AT and rank == world - 1
                        d1(x).square().mean().backward()
                    d1(x).square().mean().backward()
                    d2(y).square().mean().backward()
                    opt.step()
                except RankError as exc:
                    raised.append((i, str(exc).splitlines()[0]))
    except RankError as exc:  # a rank that had joined: the failure, as it leaves
        raised.append((-1, str(exc).splitlines()[0]))
    params = [p.detach().clone() for p in (*m1.parameters(), *m2.parameters())]
    return {"raised": raised, "total": met_by_all(rank), "params": params}


@pytest.fixture(scope="module", params=list(CASES))
def trained(request: pytest.FixtureRequest) -> tuple[str, dict[int, Any]]:
    world, batches = CASES[request.param]
    run = functools.partial(_train, batches=batches)
    return request.param, every_rank_ok(run, world, timeout=90)


def test_every_rank_raises_the_failure_once_and_the_ranks_stay_in_step(
    trained: tuple[str, dict[int, Any]],
) -> None:
    import torch

    case, results = trained
    world, batches = CASES[case]
    boom = f"rank {world - 1} in forward: ValueError: boom"
    for rank, result in results.items():
        where = AT if batches[rank] > AT else -1
        assert result["raised"] == [(where, boom)], (case, rank, result["raised"])
        assert result["total"] == world * (world + 1) / 2, (case, rank)
        for a, b in zip(result["params"], results[0]["params"], strict=True):
            assert torch.equal(a, b), (case, rank)
