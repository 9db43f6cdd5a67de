"""A rank that goes on under ``join()`` after its peers aborted the group names them.

Gloo ranks under ``ddp.join()``, rank ``r`` with ``3 + r`` batches; rank 1 raises in its
forward pass at its second step, and every other rank, catching the ``RankError``, calls
``abort_group()`` (as a user's error handler might) and leaves. Rank 1 catches its own
error and goes on. Its next step raised c10d's bare "Wait timeout" (its DDP's new group
waited for the peers), the one after named rank 0 as "stopped answering", and leaving
the join context gloo's "Connection closed by peer". Now each says that rank 0 aborted
the process group (and which others did), that a new group is needed, within the DDP's
timeout. PyTorch's DDP in that sequence (both ranks raising, rank 0 aborting) raises
gloo's "Connection reset by peer" at every later collective, naming no rank.
"""

from __future__ import annotations

import os
import time

import pytest
from ranks import armed_linear, run_ranks

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
TIMEOUT = 3.0


def _aborted_under_join(rank: int, world: int) -> list[str]:
    import torch

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.failure import abort_group

    os.environ.update(FAST)
    model, armed = armed_linear()
    ddp = DistributedDataParallel(model, timeout=TIMEOUT)
    log: list[str] = []
    start = time.monotonic()

    def step() -> None:
        ddp(torch.randn(3, 4)).pow(2).mean().backward()

    def record(where: str, exc: Exception) -> None:
        log.append(f"{where} {time.monotonic() - start:.1f} {type(exc).__name__}: {exc}")

    try:
        with ddp.join():
            for i in range(3 + rank):
                armed[0] = rank == 1 and i == 1
                try:
                    step()
                except Exception as exc:
                    record(f"step{i}", exc)
                    if rank != 1:
                        abort_group()
                        raise
    except Exception as exc:
        if rank != 1:
            return log
        record("exit", exc)
    try:
        step()
    except Exception as exc:
        record("after", exc)
    return log


@pytest.mark.parametrize("world", [2, 3])
def test_steps_and_join_exit_name_the_ranks_that_aborted_the_group(world: int) -> None:
    results, codes = run_ranks(_aborted_under_join, world, timeout=60)
    assert all(code == 0 for code in codes.values()), (codes, results)
    log = results[1][1]
    assert log[0].split(" ", 2)[2] == "RankError[ValueError]: rank 1 in forward: ValueError: boom"
    later = [line for line in log if not line.startswith("step1 ")]
    assert [line.split(" ")[0] for line in later] == ["step2", "step3", "exit", "after"], log
    also = " (so did ranks [2])" if world == 3 else ""
    for line in later:
        _, seconds, text = line.split(" ", 2)
        assert text.startswith(f"RankUnresponsiveError: rank 0: aborted the process group{also}")
        assert "make a new group" in text, text
        assert float(seconds) < 2 * TIMEOUT + 3, log
    for peer in range(world):
        if peer != 1:
            assert results[peer][1] == [
                f"step1 {results[peer][1][0].split(' ')[1]} RankError: rank 1 in forward: "
                "ValueError: boom"
            ]
