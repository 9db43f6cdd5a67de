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
    text, tables = report(args, [_results(step=0.01, busy=0.006)], ["gpipe"])
    speed, simulated, memory = (t.records() for t in tables)
    assert speed == [
        {
            "schedule": "gpipe",
            "torch_s": 0.02,
            "xgrad_s": 0.01,
            "ratio": 0.5,
            "ratio_low": 0.5,
            "ratio_high": 0.5,
            "launch_lows": "0.5",
            "launch_ratios": "0.5",
            "launch_highs": "0.5",
            "verdict": "met",
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
    assert (
        "gpipe       0.02000       0.01000   0.500 [0.500, 0.500] met     0.500 [0.500, 0.500]"
        in text
    )
    assert row["ok"] is False and text.rstrip().count("MISSED") == 1  # bubble off by 5 points
    assert "stage 1: gpipe torch_heap=1.00 MiB, xgrad_heap=0.50 MiB" in text
    assert (
        to_csv(tables)
        .splitlines()[0]
        .startswith("table,schedule,torch_s,xgrad_s,ratio,ratio_low,ratio_high,launch_lows,")
    )


def test_the_ratio_is_the_median_of_per_step_pairs() -> None:
    """Each step's xgrad time over the same pair's torch time (the slowest rank's), the
    median of those with its interval: one slow step on either side moves it little."""
    from xgrad.torch_backend.pipeline_launches import speed

    per_rank = _results(step=0.01, busy=0.006)
    per_rank[0]["gpipe"] |= {
        "torch_steps": [0.020, 0.020, 0.090, 0.020, 0.020],
        "xgrad_steps": [0.010, 0.030, 0.010, 0.010, 0.012],
    }
    per_rank[1]["gpipe"] |= {
        "torch_steps": [0.021, 0.019, 0.019, 0.019, 0.019],
        "xgrad_steps": [0.009, 0.009, 0.009, 0.011, 0.009],
    }
    row = speed([per_rank], "gpipe")
    # per step, the slowest rank: torch .021 .020 .090 .020 .020, xgrad .010 .030 .010 .011 .012
    assert (row.torch_s, row.xgrad_s) == pytest.approx((0.020, 0.011))
    ratios = sorted([0.010 / 0.021, 0.030 / 0.020, 0.010 / 0.090, 0.011 / 0.020, 0.012 / 0.020])
    assert row.ratio == pytest.approx(ratios[2])
    # 5 steps are too few for 95%: the interval is their whole range, and no verdict.
    assert (row.low, row.high) == pytest.approx((ratios[0], ratios[-1]))
    assert row.launches == ((row.low, row.ratio, row.high),) and row.verdict == "too-few"


def _launch(xgrad_steps: list[float], heap: int = 2**19) -> list[dict]:
    """One launch's per-rank results whose torch steps all took 20 ms on both ranks, and
    xgrad's ``xgrad_steps`` on rank 0 (rank 1 a little faster): ratios = steps / 0.02."""
    per_rank = _results(step=0.01, busy=0.006)
    for rank, res in enumerate(per_rank):
        mine = [t * (1.0 - 0.1 * rank) for t in xgrad_steps]
        res["gpipe"] |= {"torch_steps": [0.02] * len(mine), "xgrad_steps": mine}
        res["gpipe"]["peaks"] = res["gpipe"]["peaks"] | {"xgrad_heap_bytes": heap}
    return per_rank


@pytest.mark.parametrize(
    ("second", "expected"),
    [
        ([0.0218, 0.0212, 0.0216, 0.0214, 0.0211, 0.022, 0.0219, 0.0213, 0.0215], "noise"),
        ([0.0195, 0.0191, 0.0193, 0.0197, 0.0194, 0.0196, 0.0198, 0.0192, 0.0199], "met"),
        # At 1.00 give or take 2%: noise, though the pooled interval (x_5 to x_14 of 18)
        # lies at or below 1.00 (its x_14 is the 1.000 step).
        ([0.0196, 0.0197, 0.0198, 0.0199, 0.02, 0.0201, 0.0202, 0.0203, 0.0204], "noise"),
        # One step above 1.00 of 9: outside the launch's 95% interval (x_2 to x_8).
        ([0.0195, 0.0191, 0.0193, 0.0197, 0.0194, 0.0196, 0.0198, 0.0192, 0.0218], "met"),
    ],
)
def test_the_verdict_needs_every_launch_to_say_so(second: list[float], expected: str) -> None:
    """The first launch is below 1.00 on its own (all 9 ratios 0.95-0.99); the verdict is
    met only when the second is too, noise when it is above: a rerun could have printed
    either. The pooled median and interval come from all 18 steps."""
    from xgrad.bench_stats import median_interval
    from xgrad.torch_backend.pipeline_report import report

    first = [0.0190, 0.0192, 0.0198, 0.0194, 0.0196, 0.0193, 0.0191, 0.0195, 0.0197]
    args = argparse.Namespace(stages=2, microbatches=2, batch=8, width=4, layers=1)
    args.backend, args.steps = "gloo", 18
    text, tables = report(args, [_launch(first), _launch(second, heap=2**21)], ["gpipe"])
    (row,) = tables[0].records()
    assert row["verdict"] == expected
    each = [median_interval([t / 0.02 for t in launch]) for launch in (first, second)]
    assert [float(v) for v in row["launch_ratios"].split("/")] == [mid for _, mid, _ in each]
    assert [float(v) for v in row["launch_highs"].split("/")] == [high for *_, high in each]
    low, mid, high = median_interval([t / 0.02 for t in first + second])
    assert (row["ratio_low"], row["ratio"], row["ratio_high"]) == (low, mid, high)
    assert "median of 18 timed steps over 2 launch(es)" in text
    line = next(line for line in text.splitlines() if line.startswith("gpipe "))
    # Each launch's median and interval, which the verdict judges.
    shown = "  ".join(f"{m:.3f} [{low:.3f}, {high:.3f}]" for low, m, high in each)
    assert line.endswith(f" {expected:<7} {shown}")
    # Memory: the most any launch measured.
    peaks = {(r["stage"], r["figure"]): r["bytes"] for r in tables[2].records()}
    assert peaks[(0, "xgrad_heap")] == peaks[(1, "xgrad_heap")] == 2**21


def test_launches_that_are_both_above_miss() -> None:
    from xgrad.torch_backend.pipeline_launches import speed

    high = [0.0218, 0.0212, 0.0216, 0.0214, 0.0211, 0.022, 0.0219]
    assert speed([_launch(high), _launch(high[::-1])], "gpipe").verdict == "missed"


def test_the_simulator_takes_two_launches_as_one_of_their_steps() -> None:
    """Pooled, two launches of one step each give the simulator section of one launch of
    both steps: a launch is just more steps (records, times, setup, between actions)."""
    from xgrad.torch_backend.pipeline_report import report

    def launch(shift: float, pre: float) -> list[dict]:
        per_rank = _results(step=0.01, busy=0.006)
        records = [
            [("0F0", 0.0, 1e-3, 0.0), ("0SEND_F0", 1e-3, 1.2e-3, 0.0)],
            [("1F0", 1e-3, 3e-3 + shift, 4e-4 + shift)],
        ]
        for rank, res in enumerate(per_rank):
            res["gpipe"] |= {
                "records": [records[rank]],
                "xgrad_steps": [0.01 + shift],
                "torch_steps": [0.02],
                "busy_steps": [0.006],
                "dispatch_steps": [5e-5],
                "pre_steps": [pre],
                "post_steps": [3e-4],
            }
        return per_rank

    args = argparse.Namespace(stages=2, microbatches=2, batch=8, width=4, layers=1)
    args.backend, args.steps = "gloo", 2
    a, b = launch(0.0, 2e-4), launch(1e-3, 4e-4)
    both = launch(0.0, 2e-4)
    for rank, res in enumerate(both):
        for key in ("records", "xgrad_steps", "torch_steps", "pre_steps"):
            res["gpipe"][key] = res["gpipe"][key] + b[rank]["gpipe"][key]
    _, two = report(args, [a, b], ["gpipe"])
    _, one = report(args, [both], ["gpipe"])
    assert two[1].records() == one[1].records()
    (row,) = one[1].records()
    # Each step's time less its actions' span (10 - 3 ms, 11 - 4 ms): their median.
    assert row["fixed_us"] == pytest.approx(7000)
    assert row["measured_s"] == pytest.approx(0.0105)  # the median of 10 and 11 ms


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
    _, tables = report(args, [per_rank], ["gpipe"])
    (row,) = tables[1].records()
    assert row["message_us"] == 0.0


def test_pooling_refuses_launches_of_different_sizes() -> None:
    from xgrad.torch_backend.pipeline_launches import pool, speed

    with pytest.raises(ValueError, match=r"different numbers of ranks \[1, 2\]"):
        pool([_launch([0.02]), _launch([0.02])[:1]], ["gpipe"])
    with pytest.raises(ValueError, match="no launches of 'gpipe'"):
        speed([], "gpipe")
