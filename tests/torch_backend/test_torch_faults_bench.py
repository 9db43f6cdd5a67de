"""``xgrad bench faults``: one real cell per system kind, every verdict computed, not assumed."""

from __future__ import annotations

import pytest

from xgrad.torch_backend.faults_bench import COLUMNS, reference_cell, run_matrix, table
from xgrad.torch_backend.faults_cells import named_origin


def test_named_origin_reads_the_rank_an_error_starts_with() -> None:
    assert named_origin("RankError: rank 1 in comm hook, bucket 0: boom") == 1
    assert named_origin("rank 0: collective aborted because rank 2 failed: x") == 2
    assert named_origin("Connection closed by peer") is None


@pytest.mark.slow
def test_a_ddp_cell_and_a_reference_cell_are_all_yes() -> None:
    rows = [*run_matrix([("ddp", "raise", "comm hook")], [2], timeout=5.0), reference_cell(3)]
    for row in rows:
        for column in COLUMNS:
            if column != "time to error s":
                assert row[column] == "yes", (column, row)
    ddp = rows[0]
    assert ddp["time to error s"] < 5.0
    assert all("rank 1 in comm hook, bucket 0" in e for e in ddp["errors"]), ddp["errors"]
    text = table(rows)
    assert text.splitlines()[0].startswith("| system | fault | where | world | every rank raised")
    assert "| ddp | raise | comm hook | 2 | yes | yes |" in text
