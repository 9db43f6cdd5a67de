"""A rank's synchronised backward pass raises and it runs no forward pass after it.

Three gloo ranks train three steps; at the last, rank 1's backward pass raises between
the layers (after DDP's first gradient hooks: its buckets began). Before, the pass was
posted to the step's failure channel at rank 1's next forward pass, and it had none:
with the exception caught and the rank busy afterwards (saving a checkpoint, here a
sleep past the DDP's timeout), its peers waited in the step's reduction to the timeout
("did not answer within the timeout"); with it uncaught, until its process ended, and
then named it as one that "stopped answering". Either way not its exception. Now the pass
is posted as the exception leaves the backward call (:mod:`xgrad.torch_backend.ddp_cut_short`),
and the peers raise ``rank 1 in backward: ValueError: ...`` at once. Also checked: the
steps before trained (their gradients equal to every rank's inputs'), and rank 1's own
error is its exception.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
from ranks import armed_between, run_ranks

WORLD = 3
STEPS = 3
TIMEOUT = 3.0


def _inputs(rank: int, step: int) -> Any:
    import torch

    return torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + step))


def _run(rank: int, world: int, caught: bool) -> dict[str, Any]:
    import copy

    import torch

    from xgrad.torch_backend import DistributedDataParallel

    model, armed = armed_between(rank)
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    right: list[bool] = []
    error, started = "", 0.0
    for step in range(STEPS):
        ddp.zero_grad()
        armed["on"] = rank == 1 and step == STEPS - 1
        started = time.monotonic()
        try:
            ddp(_inputs(rank, step)).square().mean().backward()
        except Exception as exc:
            if not caught and rank == 1:
                raise  # its process ends with it (the peers catch theirs)
            error = f"{type(exc).__name__}: {exc}"
            break
        ref = copy.deepcopy(model)
        ref.zero_grad()
        for r in range(world):
            (ref(_inputs(r, step)).square().mean() / world).backward()
        pairs = zip(model.parameters(), ref.parameters(), strict=True)
        right.append(all(torch.allclose(a.grad, b.grad, atol=1e-6) for a, b in pairs))
    waited = time.monotonic() - started
    if rank == 1:
        time.sleep(TIMEOUT + 2.0)  # busy after the loop (a checkpoint), the group alive
    return {"error": error, "waited": waited, "right": right}


@pytest.mark.parametrize("caught", [True, False], ids=["caught, then busy", "uncaught"])
def test_the_peers_raise_the_exception_at_once(caught: bool) -> None:
    results, codes = run_ranks(functools.partial(_run, caught=caught), WORLD, timeout=120)
    assert all(code == 0 for code in codes.values()), (codes, results)
    status, own = results[1]
    if caught:
        assert status == "ok" and own["error"] == "ValueError: boom on rank 1", results[1]
        assert own["right"] == [True] * (STEPS - 1), own
    else:
        assert status == "error" and "ValueError: boom on rank 1" in own, results[1]
    for peer in (0, 2):
        status, value = results[peer]
        assert status == "ok", (peer, value)
        assert value["error"].startswith("RankError: rank 1 in backward: ValueError: boom"), (
            peer,
            value,
        )
        assert value["waited"] < TIMEOUT, (peer, value)  # not a wait to the timeout
        assert value["right"] == [True] * (STEPS - 1), (peer, value)
