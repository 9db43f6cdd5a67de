"""``xgrad bench jax`` runs end to end at a tiny size (its speed is not tested)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("jax")

from xgrad.cli import main
from xgrad.jax_backend.bench import BenchCase, format_table


def test_bench_jax_prints_bucketed_and_leafwise_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    table = tmp_path / "bench.csv"
    argv = ["bench", "jax", "--steps", "2", "--no-torch", "--json", str(out), "--csv", str(table)]
    assert main(argv) == 0
    lines = table.read_text().splitlines()
    assert lines[0].startswith("variant,ms_per_step,model,world_size,") and len(lines) == 5
    text = capsys.readouterr().out
    assert "3 buckets of <= 2048 B vs 6 leaves" in text
    rows = json.loads(out.read_text())["bench jax"]
    assert [r["variant"] for r in rows] == [
        "shard_map bucketed",
        "shard_map leaf-by-leaf",
        "pmap bucketed",
        "pmap leaf-by-leaf",
    ]  # no torch rows with --no-torch
    assert all(r["ms_per_step"] > 0 and r["model"] == "mlp" and r["steps"] == 2 for r in rows)


def test_table_shows_ratios_to_torch() -> None:
    jax_s = {
        "shard_map bucketed": 0.002,
        "shard_map leaf-by-leaf": 0.004,
        "pmap bucketed": 0.010,
        "pmap leaf-by-leaf": 0.010,
    }
    torch_s = {"torch DDP": 0.004, "xgrad torch DDP": 0.005}
    lines = format_table(BenchCase(), jax_s, torch_s).splitlines()
    shard_map = next(line for line in lines if line.strip().startswith("shard_map"))
    assert shard_map.split()[-2:] == ["0.50", "0.50"]  # vs leaf-by-leaf, vs torch DDP
    pmap = next(line for line in lines if line.strip().startswith("pmap"))
    assert pmap.split()[-2:] == ["1.00", "2.50"]
    assert any("xgrad torch DDP" in line and "x1.25 of torch DDP" in line for line in lines)
