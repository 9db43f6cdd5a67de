"""``xgrad bench graph`` runs at a small size and agrees with a plain walk."""

from __future__ import annotations

import csv
import json
import pathlib

import pytest

from xgrad.dependencies import compute_dependencies


def test_bench_runs_on_a_small_graph(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from xgrad import graph_bench
    from xgrad.cli import main

    argv = ["bench", "graph", "--nodes", "2000", "--edges", "5000", "--repeat", "1"]
    assert main([*argv, "--csv", str(tmp_path / "g.csv")]) == 0
    out = capsys.readouterr().out
    assert "agree: True" in out
    (row,) = csv.DictReader((tmp_path / "g.csv").open())
    assert (row["nodes"], row["edges"], row["agree"]) == ("2000", "5000", "True")
    assert float(row["speedup"]) == pytest.approx(float(row["walk_s"]) / float(row["best_s"]))
    # JSON to standard output: only the JSON, no text around it.
    assert main([*argv, "--no-baseline", "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)["bench graph"]
    assert record["nodes"] == 2000 and record["walk_s"] is None and record["agree"] is None
    g, roots, sends = graph_bench.random_graph(500, 1200, seed=3)
    assert graph_bench.plain_walk(g, roots, sends) == {
        k: v for k, v in compute_dependencies(g, roots, sends).table().items() if v
    }


@pytest.mark.parametrize(
    "argv",
    [["--nodes", "3"], ["--nodes", "100", "--edges", "50"], ["--repeat", "0"]],
)
def test_bad_sizes_are_refused_naming_the_options(argv: list[str]) -> None:
    from xgrad.cli import main

    with pytest.raises(ValueError, match=r"expected --nodes >= 4, --edges >= --nodes"):
        main(["bench", "graph", *argv])


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (2.5e-4, "250 µs"),
        (1.234e-3, "1.23 ms"),
        (0.5, "500 ms"),
        (3.21, "3.21 s"),
        (4321.0, "4321 s"),
    ],
)
def test_durations_keep_three_significant_figures(seconds: float, shown: str) -> None:
    """A small graph's pass printed as "0.000 s" at a fixed three decimals."""
    from xgrad.graph_bench import _duration

    assert _duration(seconds) == shown
