"""The bucket-size sweep: virtual times against a hand-derived timeline, files, determinism."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from xgrad.cli import main
from xgrad.experiments.bucket_sweep import SweepConfig, bucket_sweep, run_point
from xgrad.reference import LinkModel

# A 2-layer 8-wide MLP, 4 samples per rank, 1 Mflop/s: every step is a whole number of
# microseconds, so the timeline below can be derived by hand.
TINY = SweepConfig(
    world_sizes=(4,),
    bucket_caps=((8 * 8 + 8) * 4,),  # exactly one layer's weight and bias
    width=8,
    layers=2,
    batch_per_rank=4,
    alpha=1e-4,
    beta=1e-6,
    flops_per_second=1e6,
    iterations=2,
)


def test_two_buckets_follow_the_hand_timeline() -> None:
    row = run_point(TINY, 4, TINY.bucket_caps[0])
    c = LinkModel(1e-4, 1e-6).allreduce_seconds(288, 4)  # one bucket of 288 bytes
    forward = 2 * (2 * 4 * 64) / 1e6  # two layers, 2*B*in*out flops each
    t1 = forward + 2 * 2 * 4 * 64 / 1e6  # layer 1's backward (input and weight grads)
    t2 = t1 + 2 * 4 * 64 / 1e6  # layer 0's backward (no input grad)
    # Bucket 0 (layer 1) starts at t1; bucket 1 waits for the link as well as for t2.
    iteration = max(t2, t1 + c) + c
    assert row.buckets == 2
    assert row.compute_ms == pytest.approx(t2 * 1e3, rel=1e-12)
    assert row.comm_ms == pytest.approx(2 * c * 1e3, rel=1e-12)
    assert row.iteration_ms == pytest.approx(iteration * 1e3, rel=1e-12)
    assert row.exposed_comm_ms == pytest.approx((iteration - t2) * 1e3, rel=1e-12)


def test_one_bucket_cannot_overlap_and_one_rank_does_not_communicate() -> None:
    total = 2 * (8 * 8 + 8) * 4
    one = run_point(TINY, 4, 1 << 20)
    assert one.buckets == 1
    expected = one.compute_ms + LinkModel(1e-4, 1e-6).allreduce_seconds(total, 4) * 1e3
    assert one.iteration_ms == pytest.approx(expected, rel=1e-12)
    assert one.overlap_pct == 0.0
    alone = run_point(TINY, 1, 288)
    assert alone.comm_ms == 0.0
    assert alone.iteration_ms == pytest.approx(alone.compute_ms, rel=1e-12)


def test_sweep_is_reproducible_and_writes_csv_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "experiment", "bucket-sweep", "--world-sizes", "2,3", "--caps", "300,100000",
        "--width", "8", "--layers", "3", "--batch-per-rank", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "ranks" in out and "overlap %" in out and "bucket_sweep.csv" in out
    with (tmp_path / "bucket_sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["world_size"], r["bucket_cap_bytes"]) for r in rows] == [
        ("2", "300"), ("2", "100000"), ("3", "300"), ("3", "100000"),
    ]  # fmt: skip
    doc = json.loads((tmp_path / "bucket_sweep.json").read_text())
    assert doc["config"]["layers"] == 3 and len(doc["rows"]) == 4
    first = (tmp_path / "bucket_sweep.json").read_text()
    assert main(args) == 0
    assert (tmp_path / "bucket_sweep.json").read_text() == first


def test_more_ranks_cost_more_for_the_same_buckets() -> None:
    config = SweepConfig(
        world_sizes=(2, 16, 64), bucket_caps=(1 << 20,), width=8, layers=2, batch_per_rank=1
    )
    times = [r.iteration_ms for r in bucket_sweep(config)]
    assert times == sorted(times) and times[0] < times[-1]


def test_fp16_hook_halves_the_bytes_on_the_wire() -> None:
    half = run_point(replace(TINY, hook="fp16"), 4, TINY.bucket_caps[0])
    c = LinkModel(1e-4, 1e-6).allreduce_seconds(288 // 2, 4)
    assert half.buckets == 2
    assert half.comm_ms == pytest.approx(2 * c * 1e3, rel=1e-12)
