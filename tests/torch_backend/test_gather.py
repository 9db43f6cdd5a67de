"""gather_ranks: every survivor's report, exit codes, and no wait on a frozen rank."""

from __future__ import annotations

import os
import time
from typing import Any

from xgrad.torch_backend.gather import ERROR, OK, gather_ranks


def _mixed(rank: int, world: int, tag: str) -> str:
    if rank == 1:
        raise ValueError(f"rank 1 fails on purpose ({tag})")
    if rank == 2:
        time.sleep(600)  # frozen: not waited for, killed at the end
    return f"{tag} {rank}/{world} {os.environ.get('XGRAD_GATHER_TEST')}"


def test_reports_errors_and_kills_what_is_not_awaited() -> None:
    start = time.monotonic()
    results, codes = gather_ranks(
        _mixed, 3, ("hi",), limit=60, wait_for=[0, 1], env={"XGRAD_GATHER_TEST": "set"}
    )
    assert time.monotonic() - start < 45  # ended when ranks 0 and 1 exited, not at the limit
    assert results[0] == (OK, "hi 0/3 set")
    status, text = results[1]
    assert status == ERROR
    assert text.startswith("ValueError: rank 1 fails on purpose (hi)")
    assert 2 not in results
    assert codes == {0: 0, 1: 0, 2: None}


def _tensors(rank: int, world: int) -> list[Any]:
    """Returns tensors: they once travelled as shared-memory handles, which the parent
    could no longer open once the rank had exited (``FileNotFoundError``, ``EOFError``);
    each result is now pickled to bytes in the rank."""
    import torch

    return [torch.full((1000,), float(rank)) for _ in range(4)]


def test_tensors_come_back_from_ranks_that_exited() -> None:
    for _ in range(3):
        results, codes = gather_ranks(_tensors, 3, limit=60)
        for rank in range(3):
            status, value = results[rank]
            assert status == OK, value
            assert [float(t[0]) for t in value] == [float(rank)] * 4
            assert codes[rank] == 0
