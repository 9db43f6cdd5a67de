"""``xgrad bench faults``: one real cell per system kind, every verdict computed, not assumed."""

from __future__ import annotations

import pathlib

import pytest

from xgrad.cli import main
from xgrad.tables import to_csv
from xgrad.torch_backend.faults_bench import (
    COLUMNS,
    reference_cell,
    rows_table,
    run_matrix,
    table,
)
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


@pytest.mark.slow
def test_a_killed_middle_pipeline_stage_is_named_by_both_neighbours() -> None:
    """SIGKILL of rank 1 (the middle stage of 3, real gloo processes) in its forward pass:
    rank 0 waits on a gradient from it and rank 2 on an activation; gloo closes their
    connections, and both name rank 1 (its heartbeat stopped), not themselves. The next
    step raises the same named error at once instead of waiting on the dead rank."""
    (row,) = run_matrix([("pipeline", "kill", "forward")], [3], timeout=4.0)
    for column in COLUMNS:
        if column != "time to error s":
            assert row[column] == "yes", (column, row)
    assert row["time to error s"] < 4.0 * 3, row
    assert len(row["errors"]) == 2, row["errors"]
    for error in row["errors"]:
        assert error.startswith("RankUnresponsiveError: rank 1: stopped answering"), error
        assert "rank 0 in" not in error and "rank 2 in" not in error, error


def test_systems_and_faults_filters_that_match_no_cell_are_refused() -> None:
    import argparse

    from xgrad.torch_backend.faults_bench import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--systems", "reference", "--faults", "kill"])
    with pytest.raises(ValueError, match="no cell of the matrix matches"):
        run(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["--systems", "jax"])


def test_the_reference_cell_as_json_and_csv_rows() -> None:
    row = reference_cell(2)
    data = rows_table([row]).records()
    assert data[0]["system"] == "reference" and data[0]["world"] == 2
    assert data[0]["every rank raised"] == "yes" and data[0]["time to error s"] > 0
    assert "rank 1" in data[0]["errors"]
    lines = to_csv([rows_table([row])]).splitlines()
    assert lines[0].startswith("system,fault,where,world,every rank raised")
    assert lines[1].startswith("reference,raise,comm hook,2,yes,yes,")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--worlds", "1"], "--worlds: 1 ranks cannot lose one"),
        (["--timeout", "0"], r"--timeout must be > 0 seconds, got 0\.0"),
    ],
)
def test_bad_input_is_refused_naming_the_option(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        main(["bench", "faults", *argv])


def test_json_to_a_missing_folder_is_refused_before_any_cell_runs(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "faults", "--json", f"{tmp_path}/missing/m.json"])
    err = capsys.readouterr().err
    assert "argument --json" in err and "does not exist" in err
