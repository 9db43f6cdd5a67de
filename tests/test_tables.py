"""Tables as data: aligned text, JSON records, CSV (one or several tables), statistics."""

from __future__ import annotations

import argparse
import csv
import io
import json
from pathlib import Path

import pytest

from xgrad.tables import (
    Table,
    add_table_outputs,
    near_limit,
    print_tables,
    statistics_table,
    to_csv,
    to_json,
    write_tables,
)


def test_text_aligns_numbers_right_and_shows_infinity() -> None:
    t = Table(("bucket", "limit", "members"), ((0, 2048, "a b"), (1, float("inf"), "c")), "plan")
    assert t.text().splitlines() == [
        "plan",
        "  bucket  limit  members",
        "       0   2048  a b",
        "       1      ∞  c",
    ]


def test_json_and_csv_keep_every_row() -> None:
    a = Table(("x", "y"), ((1, 0.5), (2, None)), "a")
    b = Table(("x", "z"), ((3, True),), "b")
    assert json.loads(to_json([a, b])) == {
        "a": [{"x": 1, "y": 0.5}, {"x": 2, "y": None}],
        "b": [{"x": 3, "z": True}],
    }
    rows = list(csv.reader(io.StringIO(to_csv([a, b]))))
    assert rows == [
        ["table", "x", "y", "z"],
        ["a", "1", "0.5", ""],
        ["a", "2", "", ""],
        ["b", "3", "", "True"],
    ]
    assert to_csv([a]).splitlines() == ["x,y", "1,0.5", "2,"]


def test_rows_must_match_the_columns() -> None:
    with pytest.raises(ValueError, match=r"table 't' row 1 has 1 values for 2 columns"):
        Table(("x", "y"), ((1, 2), (3,)), "t")


def test_write_tables_to_files_or_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = Table(("x",), ((1,),), "t")
    assert not write_tables([t], tmp_path / "t.json", tmp_path / "t.csv")
    assert json.loads((tmp_path / "t.json").read_text()) == {"t": [{"x": 1}]}
    assert (tmp_path / "t.csv").read_text() == "x\n1\n"
    assert write_tables([t], None, Path("-"))
    assert capsys.readouterr().out == "x\n1\n"


def test_statistics_print_as_a_table_of_their_own() -> None:
    stats = {
        "world_size": 2,
        "ready_order": [f"layer{i}.weight" for i in range(20)],
        "timeline": [{"forward": 0.1}, {"forward": 0.2}],
        "avg_backward_time": 0.25,
        "plan": '{"buckets":[[1,0]],"limits":[9223372036854775807]}',
    }
    text = statistics_table(stats).text()
    assert "world_size" in text and "2 records" in text and "0.25" in text
    assert "layer0.weight, layer1.weight" in text and "..." in text
    assert max(len(line) for line in text.splitlines()) < 100
    assert "[1,0] (caps ∞)" in text and "9223372036854775807" not in text


def test_table_outputs_are_checked_before_a_run_and_leave_stdout_parseable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="xgrad bench x")
    add_table_outputs(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--csv", str(tmp_path / "missing" / "t.csv")])
    assert "argument --csv: folder" in capsys.readouterr().err
    table = Table(("a", "ratio"), ((1, float("nan")),), "t")
    args = parser.parse_args(["--json", "--csv", str(tmp_path / "t.csv")])
    print_tables(args, [table], "the text")
    out = capsys.readouterr().out
    assert json.loads(out) == {"t": [{"a": 1, "ratio": None}]}  # NaN as null; no text
    assert (tmp_path / "t.csv").read_text() == "a,ratio\n1,nan\n"
    print_tables(parser.parse_args([]), [table], "the text")
    assert capsys.readouterr().out == "the text\n"


def test_a_results_folder_that_cannot_be_made_is_named_without_making_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from xgrad.tables import unmakeable_folder

    (tmp_path / "f").write_text("")
    assert unmakeable_folder(tmp_path / "new" / "deeper") is None
    assert not (tmp_path / "new").exists()
    assert unmakeable_folder(tmp_path / "f") == f"{str(tmp_path / 'f')!r} is a file, not a folder"
    assert unmakeable_folder(tmp_path / "f" / "x" / "y") == (
        f"cannot make folder {str(tmp_path / 'f' / 'x' / 'y')!r}: {str(tmp_path / 'f')!r} is a file"
    )
    monkeypatch.setattr("os.access", lambda path, mode: False)  # as a read-only folder is
    assert unmakeable_folder(tmp_path / "x") == (
        f"cannot make folder {str(tmp_path / 'x')!r}: {str(tmp_path)!r} is not writable"
    )
    assert unmakeable_folder(tmp_path) == f"folder {str(tmp_path)!r} is not writable"


def test_near_limit_never_prints_the_limit_for_a_figure_beside_it() -> None:
    # 3 decimals unless they would read as the limit the figure is judged against.
    assert near_limit(0.9512) == "0.951"
    assert near_limit(1.0) == "1.000"
    assert near_limit(1.0004) == "1.0004"
    assert near_limit(0.99996) == "0.99996"
    assert near_limit(1.00000004) == "1.00000004"
    assert near_limit(2.0004, limit=2.0) == "2.0004"
