"""``xgrad bench graph`` runs at a small size and agrees with a plain walk."""

from __future__ import annotations

import pytest

from xgrad.dependencies import compute_dependencies


def test_bench_runs_on_a_small_graph(capsys: pytest.CaptureFixture[str]) -> None:
    from xgrad import graph_bench
    from xgrad.cli import main

    assert main(["bench", "graph", "--nodes", "2000", "--edges", "5000", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "agree: True" in out
    g, roots, sends = graph_bench.random_graph(500, 1200, seed=3)
    assert graph_bench.plain_walk(g, roots, sends) == {
        k: v for k, v in compute_dependencies(g, roots, sends).table().items() if v
    }
