"""The report of ``xgrad bench pipeline``: its three sections as text and as tables.

Kept apart from the measuring (``pipeline_bench``): this part only reads the per-rank
results, feeds the measured costs to the simulator and formats what it finds.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from typing import Any

import xgrad.pipeline as xp
from xgrad.bench_stats import interval_label, rule
from xgrad.pipeline import Kind
from xgrad.tables import Table, near_limit
from xgrad.torch_backend.memory import HeapMeter
from xgrad.torch_backend.pipeline_launches import pool, speed
from xgrad.torch_backend.pipeline_replay import message_latencies, replay_steps

#: simulations per schedule of the pooled model, each with every (stage, kind)'s cost drawn
#: from the measured samples; its prediction is their median step.
_DRAWS = 25


def report(
    args: argparse.Namespace, launches: Sequence[list[dict[str, Any]]], names: list[str]
) -> tuple[str, list[Table]]:
    """The text the bench prints, and the same figures (seconds, fractions, bytes) as tables.

    ``launches`` holds each launch's per-rank results: the speed section judges the
    launches one by one, the others pool them (:mod:`~xgrad.torch_backend.pipeline_launches`).
    """
    p, m = args.stages, args.microbatches
    n = len(launches)
    out = [
        f"pipeline bench: p={p} stages, m={m} microbatches, batch {args.batch}, width "
        f"{args.width}, {args.layers} layers per stage, {args.backend}, median of "
        f"{args.steps} timed steps over {n} launch(es) of fresh processes"
    ]
    w = max(len(name) for name in names)
    rows = [(name, speed(launches, name)) for name in names]
    turns = min((s.turns for _, s in rows if s.turns), default=None)
    pooled = min((s.pooled for _, s in rows if s.pooled), default=0)
    label = interval_label(pooled)
    out.append(
        "ratio: the median over every launch's steps of xgrad's step over torch's step of "
        "the same pair (the two alternate, each first in every other pair; a step's time is "
        f"the slowest rank's) [{label} of that median, from order statistics]; target "
        f"<= 1.00, {rule(n, turns=turns)} (under 6 steps a launch's interval is its whole "
        "range); launches: each launch's own median [and its 95% interval]; s/step: each "
        "one's median step"
    )
    spans = [f"[{near_limit(s.low)}, {near_limit(s.high)}]" for _, s in rows]
    ws = max(len(label), *map(len, spans))
    out.append(
        f"{'schedule':<{w}} {'torch s/step':>13} {'xgrad s/step':>13} {'ratio':>7} "
        f"{label:<{ws}} {'target':<7} launches"
    )
    speed_rows = []
    for (name, s), span in zip(rows, spans, strict=True):
        each = (
            f"{near_limit(mid)} [{near_limit(lo)}, {near_limit(hi)}]" for lo, mid, hi in s.launches
        )
        # Each launch's low, median and high as ``/``-joined text, as the DDP bench's rows.
        joined = ("/".join(repr(launch[k]) for launch in s.launches) for k in range(3))
        speed_rows.append((name, s.torch_s, s.xgrad_s, s.ratio, s.low, s.high, *joined, s.verdict))
        out.append(
            f"{name:<{w}} {s.torch_s:>13.5f} {s.xgrad_s:>13.5f} {near_limit(s.ratio):>7} "
            f"{span:<{ws}} {s.verdict:<7} {'  '.join(each)}"
        )
    per_rank = pool(launches, names)
    simulated, memory = [], []
    message = per_rank[0]["message"]
    out.append(
        "\nsimulator fed measured costs: every action of each rank in order, sends and "
        "receives included; each timed step run again from its own measured costs (every "
        "action's own time, time blocked on a message left out; every message's latency "
        "from its send's end to the wake-up of the receiver that blocked on it, none when "
        "none blocked; each rank's time between actions) plus the step's fixed setup and "
        "teardown (its measured time less its actions' span: the slowest rank's time before "
        "the first action on any rank and after the last, to the closing barrier; fixed us: "
        "their median); "
        "the median over steps, compared with the median measured step (within 10%) and "
        "the median bubble (idle share of compute, the same compute on both sides, within "
        f"3 points). pooled: the step predicted from costs pooled over all steps instead "
        f"(drawn per action, median of {_DRAWS} draws, one mean latency per message, else "
        f"{message * 1e6:.0f} us from a ping-pong)"
    )
    out.append(
        f"{'schedule':<{w}} {'measured s':>11} {'simulated s':>12} {'error':>7}  "
        f"{'bubble measured':>15} {'simulated':>9} {'equal-cost':>10} {'msg us':>7}"
        f" {'dispatch us':>11} {'fixed us':>8} {'pooled':>7}"
    )
    for name in names:
        sched = xp.insert_comms(xp.make(name, p, m))
        steps = [
            [res[name]["records"][k] for res in per_rank] for k in range(_count(per_rank, name))
        ]
        # Below zero (a receiver that preempted its sender) is none, as the replay takes it.
        lags = [max(0.0, x) for recs in steps for x in message_latencies(sched, recs).values()]
        latency = statistics.mean(lags) if lags else message
        times = [
            max(ts) for ts in zip(*(r[name].get("xgrad_steps", []) for r in per_rank), strict=True)
        ]
        replayed = None
        if steps and len(times) == len(steps):
            # Each step with its own fixed part (its time outside the actions), as with its
            # own costs; the pooled model takes their median.
            replayed = replay_steps(sched, steps, times)
            fixed = replayed.fixed
        else:  # the step outside its actions, without per-step records: the ranks' edges
            fixed = min(r[name]["pre"] for r in per_rank) + min(r[name]["post"] for r in per_rank)
        pooled_step, pooled_bubble = _pooled(per_rank, name, sched, latency, fixed)
        if replayed is not None:
            step, predicted = replayed.measured, replayed.simulated
            measured, bubble = replayed.bubble_measured, replayed.bubble_simulated
        else:  # results without per-step records: each side's medians, the pooled model
            step = max(r[name]["xgrad"] for r in per_rank)
            measured = 1.0 - sum(r[name]["busy"] for r in per_rank) / (p * step)
            predicted, bubble = pooled_step, pooled_bubble
        equal = xp.simulate(sched)
        error = predicted / step - 1.0
        pooled_error = pooled_step / step - 1.0
        ok = abs(error) <= 0.10 and abs(bubble - measured) <= 0.03
        figures = (step, predicted, error, measured, bubble, equal.bubble_fraction)
        dispatch = [res[name]["dispatch"] for res in per_rank]
        us = (latency * 1e6, statistics.median(dispatch) * 1e6, fixed * 1e6)
        simulated.append((name, *figures, *us, pooled_error, ok))
        out.append(
            f"{name:<{w}} {step:>11.5f} {predicted:>12.5f} {error:>+7.1%}  "
            f"{measured:>15.3f} {bubble:>9.3f} {equal.bubble_fraction:>10.3f}"
            f" {us[0]:>7.0f} {us[1]:>11.0f} {us[2]:>8.0f} {pooled_error:>+7.1%}"
            f"  {'ok' if ok else 'MISSED'}"
        )
    out.append(f"\npeak memory per stage, MiB ({_memory_legend(args.backend, n)})")
    for r, res in enumerate(per_rank):
        cells = []
        for name in names:
            # In the order measured: torch, then xgrad, then xgrad's own count.
            peaks = res[name]["peaks"]
            memory += [(r, name, k.replace("_bytes", ""), v) for k, v in peaks.items()]
            cells.append(
                f"{name} "
                + ", ".join(
                    f"{k.replace('_bytes', '')}={v / 2**20:.2f} MiB" for k, v in peaks.items()
                )
            )
        out.append(f"stage {r}: " + " | ".join(cells))
    return "\n".join(out), _tables(speed_rows, simulated, memory)


def _pooled(
    per_rank: list[dict[str, Any]], name: str, sched: Any, latency: float, fixed: float
) -> tuple[float, float]:
    """``(step, bubble)`` predicted from costs pooled over every timed step: each action's
    cost drawn from the samples of its stage and kind, one mean latency for every message,
    each rank's median time between actions; the median step of the draws."""
    p = sched.num_ranks
    dispatch = [res[name]["dispatch"] for res in per_rank]
    samples = {
        (stage, Kind(kind)): c
        for res in per_rank
        for (stage, kind), c in res[name].get("samples", {}).items()
    }
    if not samples:  # results without samples: each mean, as one sample
        samples = {
            (stage, Kind(kind)): [c]
            for res in per_rank
            for (stage, kind), c in res[name]["costs"].items()
        }
    makespans, busies = [], []
    rng = random.Random(0)
    actions = [a for r in range(p) for a in xp.expand(sched.actions[r])]
    for _ in range(_DRAWS):
        drawn = {a: rng.choice(samples.get((a.stage, a.kind), [0.0])) for a in actions}
        sim = xp.simulate_messages(
            sched, drawn.__getitem__, latency=latency, dispatch=dispatch.__getitem__
        )
        makespans.append(sim.makespan)
        busies.append(sum(sim.busy))
    predicted = statistics.median(makespans) + fixed
    return predicted, 1.0 - statistics.mean(busies) / (p * predicted)


#: the columns of the three sections' tables (``--json``/``--csv``).
_SPEED = (
    *("schedule", "torch_s", "xgrad_s", "ratio", "ratio_low", "ratio_high"),
    *("launch_lows", "launch_ratios", "launch_highs", "verdict"),
)
_SIMULATED = (
    *("schedule", "measured_s", "simulated_s", "error", "bubble_measured"),
    *("bubble_simulated", "bubble_equal_cost", "message_us", "dispatch_us", "fixed_us"),
    *("pooled_error", "ok"),
)


def _tables(speed: list, simulated: list, memory: list) -> list[Table]:
    """The three sections as data (seconds, fractions, bytes), for ``--json``/``--csv``."""
    return [
        Table(_SPEED, tuple(speed), "bench pipeline"),
        Table(_SIMULATED, tuple(simulated), "simulator"),
        Table(("stage", "schedule", "figure", "bytes"), tuple(memory), "peak memory"),
    ]


def _count(per_rank: list[dict[str, Any]], name: str) -> int:
    """How many timed steps every rank recorded."""
    return min(len(res[name]["records"]) for res in per_rank)


def _memory_legend(backend: str, launches: int) -> str:
    """What each figure of the memory section is (the most any launch measured)."""
    own = "xgrad_activation: xgrad's own count of microbatch activations and their grads held"
    if backend == "nccl":
        return (
            f"cuda: torch.cuda.max_memory_allocated over one step, the most of {launches} "
            f"launch(es); {own}"
        )
    return (
        f"heap: C heap in use above the step's start ({HeapMeter().source}), peak polled by "
        f"a thread during the step, max of 3 steps in each of {launches} launch(es); {own}"
    )
