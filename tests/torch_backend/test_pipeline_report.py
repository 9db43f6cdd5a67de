"""The bench's report: its text and its tables say the same, from the same per-rank results."""

from __future__ import annotations

import argparse

import pytest

import xgrad.pipeline as xp
from xgrad.tables import to_csv

pytest.importorskip("torch")


def _results(step: float, busy: float) -> list[dict]:
    """Per-rank results as the bench's workers return them: gpipe, 2 stages, 2 microbatches,
    every forward 1 ms and every backward 2 ms, each send 0.5 ms, 50 us between actions,
    0.2 ms before the first action and 0.3 ms after the last, no message records (the
    ping-pong is used)."""
    per_rank = []
    for rank in range(2):
        costs = {(rank, "F"): 1e-3, (rank, "B"): 2e-3, (rank, "SEND_F"): 5e-4}
        costs[(rank, "SEND_B")] = 5e-4
        peaks = {"torch_heap_bytes": 2**20, "xgrad_heap_bytes": 2**19, "xgrad_activation_bytes": 0}
        gpipe = {"torch": 2 * step, "xgrad": step, "busy": busy, "records": [], "costs": costs}
        gpipe |= {"dispatch": 5e-5, "pre": 2e-4, "post": 3e-4}
        per_rank.append({"message": 1e-4, "gpipe": gpipe | {"peaks": peaks}})
    return per_rank


def test_the_text_and_the_tables_hold_the_same_figures() -> None:
    from xgrad.torch_backend.pipeline_report import report

    args = argparse.Namespace(stages=2, microbatches=2, batch=8, width=4, layers=1)
    args.backend, args.steps = "gloo", 1
    text, tables = report(args, _results(step=0.01, busy=0.006), ["gpipe"])
    speed, simulated, memory = (t.records() for t in tables)
    assert speed == [
        {
            "schedule": "gpipe",
            "torch_s": 0.02,
            "xgrad_s": 0.01,
            "ratio": 0.5,
            "ratio_q1": 0.5,
            "ratio_q3": 0.5,
            "ok": True,
        }
    ]

    kinds = {xp.Kind.FORWARD: 1e-3, xp.Kind.BACKWARD: 2e-3}
    kinds[xp.Kind.SEND_F] = kinds[xp.Kind.SEND_B] = 5e-4

    def cost(action: xp.Action) -> float:
        return kinds.get(action.kind, 0.0)

    sim = xp.simulate_messages(xp.make("gpipe", 2, 2), cost, latency=1e-4, dispatch=5e-5)
    predicted = sim.makespan + 2e-4 + 3e-4
    (row,) = simulated
    assert row["simulated_s"] == pytest.approx(predicted)
    assert row["error"] == pytest.approx(predicted / 0.01 - 1)
    assert row["bubble_measured"] == pytest.approx(1 - 2 * 0.006 / (2 * 0.01))
    assert row["bubble_simulated"] == pytest.approx(1 - 2 * 6e-3 / (2 * predicted))
    assert (row["message_us"], row["dispatch_us"], row["fixed_us"]) == pytest.approx((100, 50, 500))
    assert [(r["stage"], r["figure"], r["bytes"]) for r in memory[:2]] == [
        (0, "torch_heap", 2**20),
        (0, "xgrad_heap", 2**19),
    ]
    assert "gpipe       0.02000       0.01000   0.500  0.500  0.500  ok" in text
    assert row["ok"] is False and text.rstrip().count("MISSED") == 1  # bubble off by 5 points
    assert "stage 1: gpipe torch_heap=1.00 MiB, xgrad_heap=0.50 MiB" in text
    assert (
        to_csv(tables)
        .splitlines()[0]
        .startswith("table,schedule,torch_s,xgrad_s,ratio,ratio_q1,ratio_q3,ok")
    )


def test_the_ratio_is_the_median_of_per_step_pairs() -> None:
    """Each step's xgrad time over the same pair's torch time (the slowest rank's), the
    median of those with their quartiles: one slow step on either side moves it little."""
    from xgrad.torch_backend.pipeline_report import paired

    per_rank = _results(step=0.01, busy=0.006)
    per_rank[0]["gpipe"] |= {
        "torch_steps": [0.020, 0.020, 0.090, 0.020, 0.020],
        "xgrad_steps": [0.010, 0.030, 0.010, 0.010, 0.012],
    }
    per_rank[1]["gpipe"] |= {
        "torch_steps": [0.021, 0.019, 0.019, 0.019, 0.019],
        "xgrad_steps": [0.009, 0.009, 0.009, 0.011, 0.009],
    }
    torch_s, xgrad_s, ratio, q1, q3 = paired(per_rank, "gpipe")
    # per step, the slowest rank: torch .021 .020 .090 .020 .020, xgrad .010 .030 .010 .011 .012
    assert (torch_s, xgrad_s) == pytest.approx((0.020, 0.011))
    ratios = sorted([0.010 / 0.021, 0.030 / 0.020, 0.010 / 0.090, 0.011 / 0.020, 0.012 / 0.020])
    assert ratio == pytest.approx(ratios[2])
    assert (q1, q3) == pytest.approx((ratios[1], ratios[3]))


def test_a_receiver_woken_before_its_send_ended_counts_as_no_latency() -> None:
    """The receiver of 0SEND_F0 wakes 50 us before the send action ends (it preempted its
    sender): no message latency, as the replay takes it, not -50 us in the column and the
    pooled model."""
    from xgrad.torch_backend.pipeline_report import report

    per_rank = _results(step=0.01, busy=0.006)
    records = [
        [("0F0", 0.0, 1e-3, 0.0), ("0SEND_F0", 1e-3, 1.5e-3, 0.0)],
        [("1F0", 1e-3, 2e-3, 4.5e-4)],
    ]
    for rank, res in enumerate(per_rank):
        res["gpipe"] |= {"records": [records[rank]], "xgrad_steps": [0.01], "torch_steps": [0.02]}
    args = argparse.Namespace(stages=2, microbatches=2, batch=8, width=4, layers=1)
    args.backend, args.steps = "gloo", 1
    _, tables = report(args, per_rank, ["gpipe"])
    (row,) = tables[1].records()
    assert row["message_us"] == 0.0
