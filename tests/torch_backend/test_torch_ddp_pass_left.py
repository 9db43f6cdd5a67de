"""A rank's backward pass raises and the rank runs no forward pass after it: it leaves.

Three gloo ranks train three steps of two micro-batches (a ``no_sync`` pass, then a
synchronised one); at the last step rank 1's backward pass raises between the layers,
in the ``no_sync`` pass or the synchronised one. Rank 1 then leaves: the exception
uncaught (the launcher destroys the group), or caught and the loop stopped (destroyed
too), or uncaught with the group never destroyed (the process just ends); or it catches
it and stays busy past the DDP's timeout (a checkpoint), the group alive. Its pass was
posted at its next forward pass, and none came: outside ``join()`` (for a ``no_sync``
pass) and under ``join()`` (either pass, the exception leaving the block) its peers
waited in the step's synchronised pass to the timeout or until its connections closed,
and named it as one that did not answer or "stopped answering", not its exception. Now
the pass is posted as the exception leaves autograd outside ``join()``
(:mod:`xgrad.torch_backend.ddp_cut_short`), as rank 1 leaves otherwise
(:mod:`xgrad.torch_backend.ddp_exit`, on destroy or at the process's end; under
``join()`` as the exception leaves the block), and the peers raise
``rank 1 in backward: ValueError: ...`` at once, also under PyTorch's own ``Join`` (whose
count at the block's end then fails on the rank that left, as PyTorch's does). Also
checked: the steps before trained alike on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import pytest
from ranks import armed_between, run_ranks

WORLD = 3
STEPS = 3
TIMEOUT = 3.0
BOOM = "ValueError: boom on rank 1"


def _inputs(rank: int, step: int, micro: int) -> Any:
    import torch

    seed = 100 * rank + 10 * step + micro
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))


def _context(ddp: Any, context: str) -> Any:
    from torch.distributed.algorithms.join import Join

    if context == "join()":
        return ddp.join()
    if context == "torch Join":
        return Join([ddp])
    return contextlib.nullcontext()


def _run(rank: int, world: int, where: int, leave: str, context: str) -> dict[str, Any]:
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    model, armed = armed_between(rank)
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    if leave == "ends" and rank == 1:  # the launcher's destroy skipped: the process ends
        dist.destroy_process_group = lambda *args, **kwargs: None
    sums: list[float] = []
    error, started, left = "", 0.0, ""
    try:
        with _context(ddp, context):
            for step in range(STEPS):
                ddp.zero_grad()
                started = time.monotonic()
                try:
                    for micro in range(2):
                        armed["on"] = rank == 1 and step == STEPS - 1 and micro == where
                        sync = contextlib.nullcontext() if micro == 1 else ddp.no_sync()
                        with sync:
                            ddp(_inputs(rank, step, micro)).square().mean().backward()
                except Exception as exc:
                    if rank == 1 and leave not in ("caught", "busy"):
                        raise  # it leaves with it (the launcher reports it)
                    error = f"{type(exc).__name__}: {exc}"
                    break
                sums.append(float(sum(p.grad.sum() for p in model.parameters())))
    except Exception as exc:
        if rank == 1:
            raise
        left = f"{type(exc).__name__}: {exc}"  # the context's end, after the loop's error
    if leave == "busy" and rank == 1:
        time.sleep(TIMEOUT + 2.0)  # busy after the loop (a checkpoint), the group alive
    return {"error": error, "left": left, "waited": time.monotonic() - started, "sums": sums}


CASES = [
    ("no_sync", "busy", "plain"),
    ("no_sync", "uncaught", "plain"),
    ("no_sync", "caught", "plain"),
    ("no_sync", "ends", "plain"),
    ("synchronised", "ends", "torch Join"),
    ("no_sync", "uncaught", "join()"),
    ("synchronised", "uncaught", "join()"),
    ("no_sync", "ends", "join()"),
    ("no_sync", "uncaught", "torch Join"),
]


@pytest.mark.parametrize(("where", "leave", "context"), CASES, ids=["-".join(c) for c in CASES])
def test_the_peers_raise_the_exception_as_it_leaves(where: str, leave: str, context: str) -> None:
    run = functools.partial(
        _run, where=0 if where == "no_sync" else 1, leave=leave, context=context
    )
    results, codes = run_ranks(run, WORLD, timeout=120)
    assert all(code == 0 for code in codes.values()), (codes, results)
    status, own = results[1]
    if leave in ("caught", "busy"):
        assert status == "ok" and own["error"] == BOOM, own
    else:
        assert status == "error" and BOOM in own, own
    peers = []
    for peer in (0, 2):
        status, value = results[peer]
        assert status == "ok", (peer, value)
        assert value["error"].startswith(f"RankError: rank 1 in backward: {BOOM}"), (peer, value)
        assert value["waited"] < TIMEOUT, (peer, value)  # not a wait to the timeout
        if context == "join()":  # the block's end raises it again, with rank 1's leave
            assert value["left"].startswith(f"RankError: rank 1 in backward: {BOOM}"), value
            assert "rank 1 in join(): left join() raising this failure" in value["left"], value
        elif context == "plain":
            assert value["left"] == "", value
        peers.append(value["sums"])
    assert len(peers[0]) == STEPS - 1 and peers[0] == peers[1], peers  # trained alike
    if leave in ("caught", "busy"):
        assert own["sums"] == peers[0], (own, peers)
