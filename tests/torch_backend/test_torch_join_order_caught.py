"""Under xgrad's ``Join`` of two DDPs, a rank still training catches the order refusal and goes on.

Gloo ranks, rank 0 with one batch, the others with three; each iteration runs ``d1``'s
forward and backward passes, then ``d2``'s, in ``Join([d2, d1])`` (another order than
the context's): once rank 0 has joined, every rank raises the refusal at once
(:mod:`~xgrad.torch_backend.join_order`). Here some ranks still training catch it inside
the block (a ``try`` per iteration) and go on with their next batch. Each later pass,
and leaving the block, must raise that refusal again at once, and a join context after
it must train on every rank with ``join()``'s gradients.

Before, such a rank counted with the joined rank as it left its block, which had left
raising the refusal: its part of the joined rank's count, which had waited for the
first DDP's forward pass, was never sent; it waited to the DDP's timeout, and every
rank's next join context paired its counts with those left pending (the next step's
fresh group timed out everywhere).

* ``one``: rank 1 catches the refusal and goes on; the others raise it out of the block.
* ``all``: every rank still training catches it and goes on.
* ``second``: ``Join([d1, d2])`` with ``d2(d1(x))`` (two forward passes before one
  backward, refused by the ranks still training themselves), every one catching it.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import pytest
from ranks import every_rank_ok

TIMEOUT = 3.0
#: scenario: the ranks (from 1) that catch the refusal inside the block
CATCH = {
    "one": lambda world: {1},
    "all": lambda world: set(range(1, world)),
    "second": lambda world: set(range(1, world)),
}


def _batches(world: int, refused: bool) -> list[int]:
    """Batches per rank in the refused contexts (rank 0 joins after one), or after them."""
    return [1] + [3 if refused else 2] * (world - 1)


def _grads(models: list[Any]) -> list[Any]:
    return [p.grad.clone().numpy() for m in models for p in m.parameters()]


def _contexts(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    torch.manual_seed(0)
    models = [nn.Linear(5, 5), nn.Linear(5, 2)]
    own = [copy.deepcopy(m) for m in models]  # (a backward through a DDP's module is its)
    d1, d2 = (DistributedDataParallel(m, timeout=TIMEOUT) for m in models)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 + rank))

    def each(chain: bool) -> None:
        if chain:
            d2(d1(x)).square().sum().backward()
            return
        for ddp in (d1, d2):
            ddp(x).square().sum().backward()

    for m in own:  # this rank's own gradients (the parameters never move)
        m(x).square().sum().backward()
    out: dict[str, Any] = {"local": _grads(own)}
    # (each context made as it is entered: a join context sets up its joinables)
    plans = [(name, (d2, d1), False) for name in ("one", "all")]
    plans += [("second", (d1, d2), True), ("after", (d1, d2), False)]
    for name, joinables, chain in plans:
        catches = CATCH[name](world) if name in CATCH else set()
        batches = _batches(world, name != "after")
        steps: list[Any] = []
        started = time.monotonic()
        try:
            with Join(list(joinables)):
                for _ in range(batches[rank]):
                    for m in models:
                        m.zero_grad()
                    try:
                        each(chain)
                        steps.append(_grads(models))
                    except RuntimeError as exc:
                        steps.append(f"{time.monotonic() - started:.2f} {exc}")
                        if rank not in catches:
                            raise
            left = "left"
        except RuntimeError as exc:
            left = f"{type(exc).__name__}: {exc}"
        out[name] = {"steps": steps, "left": left, "seconds": time.monotonic() - started}
    return out


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    world = request.param
    return world, every_rank_ok(_contexts, world, timeout=60)


@pytest.mark.parametrize("name", list(CATCH))
def test_every_rank_raises_the_refusal_at_once_to_the_end_of_its_block(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    words = (
        "while DDP 0's forward pass had no backward pass yet"
        if name == "second"
        else "ran DDP 1's forward pass before DDP 0's"
    )
    for rank, result in results.items():
        run = result[name]
        assert run["seconds"] < TIMEOUT / 2, (name, rank, run)  # never the timeout
        assert run["left"].startswith("RankError: rank "), (name, rank, run)
        assert words in run["left"], (name, rank, run)
        steps = run["steps"]
        assert not isinstance(steps[0], str), (name, rank, run)  # the first step trained
        if rank == 0:
            assert len(steps) == 1, (name, rank, run)
            continue
        catches = CATCH[name](world)
        # every later batch raised it again (or the first raise left the block)
        assert len(steps) == (3 if rank in catches else 2), (name, rank, run)
        for later in steps[1:]:
            assert isinstance(later, str) and words in later, (name, rank, run)


def test_a_join_context_after_them_trains(outcome: tuple[int, dict[int, Any]]) -> None:
    world, results = outcome
    batches = _batches(world, False)
    for rank, result in results.items():
        run = result["after"]
        assert run["left"] == "left" and len(run["steps"]) == batches[rank], (rank, run)
        assert run["seconds"] < TIMEOUT, (rank, run)
        for i, grads in enumerate(run["steps"]):
            training = [r for r in results if i < batches[r]]
            for j, got in enumerate(grads):
                want = sum(results[r]["local"][j] for r in training) / world
                np.testing.assert_allclose(
                    got, want, rtol=1e-5, atol=1e-5, err_msg=f"after rank {rank} step {i}"
                )
