"""Under ``join()``, one rank still training leaves raising a failed step, another goes on.

Three gloo ranks, each scenario a join context of its own, in one run: one rank's forward
pass raises once at step 1; every rank still training gets the step's ``RankError``; rank
1 raises it again out of its join block (the user catches it outside, its process
alive), while the other ranks still training catch it inside the block and go on with
their next batch. Those must raise at once an error naming the rank where the step
failed and rank 1 leaving ``join()`` raising it, as the joined rank does; the join
contexts after it must train on every rank with ``join()``'s gradients.

Before, a rank that went on waited in the making of the next step's fresh group for
rank 1, which never came: the DDP's timeout, then an error blaming rank 0 (the joined
rank, which had stopped at once on rank 1's note) for not answering.

* ``joined``: rank 0 has one batch and joins; rank 1's forward pass raises.
* ``joined_other``: the same under ``Join([ddp])``, rank 2's forward pass raising.
* ``evaluation``: rank 2's pass after the failed step is an evaluation (``no_grad``).
* ``none``: every rank has three batches (no rank joined); ranks 0 and 2 go on.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from ranks import armed_linear, every_rank_ok

TIMEOUT = 3.0
WORLD = 3
#: the rank that raises the failed step out of its join block
LEAVES = 1

#: scenario: (batches of rank 0, 1, 2; the rank whose forward pass raises at step 1)
SCENARIOS = {
    "joined": ([1, 3, 3], 1),
    "joined_other": ([1, 3, 3], 2),
    "evaluation": ([1, 3, 3], 2),
    "none": ([3, 3, 3], 2),
}
#: contexts after them, none failing: batches of rank 0, 1, 2
AFTER = {"uneven": [1, 2, 2], "even": [2, 2, 2]}

#: the DDPs of this process, kept to its exit (as test_torch_join_left_raising's: a DDP
#: freed in gloo's thread as a failed step's pending all-reduces complete aborts it).
_KEPT: list[Any] = []


def _contexts(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from xgrad.failure_errors import RankError
    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    model, armed = armed_linear()
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    _KEPT.append(ddp)
    x = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    model(x).pow(2).mean().backward()  # this rank's own gradient: the parameters never move
    out: dict[str, Any] = {"local": [p.grad.clone().numpy() for p in model.parameters()]}
    store = dist.distributed_c10d._get_default_store()
    plans = [(name, batches, failing) for name, (batches, failing) in SCENARIOS.items()]
    plans += [(name, batches, -1) for name, batches in AFTER.items()]
    for name, batches, failing in plans:
        steps: list[Any] = []
        started = time.monotonic()
        context = Join([ddp]) if name == "joined_other" else ddp.join()
        try:
            with context:
                for i in range(batches[rank]):
                    model.zero_grad()
                    armed[0] = rank == failing and i == 1
                    try:
                        if name == "evaluation" and i == 2:
                            with torch.no_grad():
                                ddp(x)
                            steps.append("evaluated")
                            continue
                        ddp(x).pow(2).mean().backward()
                        steps.append([p.grad.clone().numpy() for p in model.parameters()])
                    except RankError as exc:
                        steps.append(f"{type(exc).__name__}: {exc}")
                        if rank == LEAVES:
                            raise
            left = "left"
        except RuntimeError as exc:
            left = f"{type(exc).__name__}: {exc}"
        out[name] = {"steps": steps, "left": left, "seconds": time.monotonic() - started}
        # Alive and idle until every rank ended the scenario (none runs a DDP step).
        store.set(f"left_mixed/{name}/{rank}", b"1")
        keys = [f"left_mixed/{name}/{r}" for r in range(world)]
        store.wait(keys, timedelta(seconds=60))
    return out


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    return every_rank_ok(_contexts, WORLD, timeout=60)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_rank_raises_at_once_naming_the_rank_that_left(
    results: dict[int, Any], name: str
) -> None:
    batches, failing = SCENARIOS[name]
    boom = f"rank {failing} in forward: ValueError: boom"
    note = f"rank {LEAVES} in join(): left join() raising this failure"
    for rank, result in results.items():
        run = result[name]
        assert run["seconds"] < TIMEOUT / 2, (name, rank, run)  # never the timeout
        kind, _, message = run["left"].partition(": ")
        assert kind.startswith("RankError") and message.startswith(boom), (name, rank, run)
        steps = run["steps"]
        assert len(steps) == min(2, batches[rank]) or rank != LEAVES, (name, rank, run)
        if batches[rank] > 1:  # it ran the failed step
            assert isinstance(steps[1], str) and boom in steps[1], (name, rank, run)
        if rank == LEAVES:
            continue
        # It stayed in join(): rank 1's note is named, at the next pass and as it leaves.
        assert note in message, (name, rank, run)
        for later in steps[2:]:
            assert isinstance(later, str) and boom in later and note in later, (name, rank)


@pytest.mark.parametrize("name", list(AFTER))
def test_join_contexts_after_them_train(results: dict[int, Any], name: str) -> None:
    batches = AFTER[name]
    for rank, result in results.items():
        run = result[name]
        assert run["left"] == "left" and len(run["steps"]) == batches[rank], (name, rank, run)
        assert run["seconds"] < TIMEOUT, (name, rank, run)
        for i, grads in enumerate(run["steps"]):
            training = [r for r in results if i < batches[r]]
            for j, got in enumerate(grads):
                want = sum(results[r]["local"][j] for r in training) / WORLD
                np.testing.assert_allclose(
                    got, want, rtol=1e-5, atol=1e-6, err_msg=f"{name} rank {rank} step {i}"
                )
