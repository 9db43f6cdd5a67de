"""gather_ranks: every survivor's report, exit codes, and no wait on a frozen rank."""

from __future__ import annotations

import os
import time

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
