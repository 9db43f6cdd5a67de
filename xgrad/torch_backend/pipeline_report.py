"""The report of ``xgrad bench pipeline``: its three sections as text and as tables.

Kept apart from the measuring (``pipeline_bench``): this part only reads the per-rank
results, feeds the measured costs to the simulator and formats what it finds.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

import xgrad.pipeline as xp
from xgrad.pipeline import Kind
from xgrad.tables import Table, near_limit
from xgrad.torch_backend.memory import HeapMeter
from xgrad.torch_backend.pipeline_replay import message_latencies, replay_steps

#: simulations per schedule of the pooled model, each with every (stage, kind)'s cost drawn
#: from the measured samples; its prediction is their median step.
_DRAWS = 25


def report(
    args: argparse.Namespace, per_rank: list[dict[str, Any]], names: list[str]
) -> tuple[str, list[Table]]:
    """The text the bench prints, and the same figures (seconds, fractions, bytes) as tables."""
    p, m = args.stages, args.microbatches
    out = [
        f"pipeline bench: p={p} stages, m={m} microbatches, batch {args.batch}, width "
        f"{args.width}, {args.layers} layers per stage, {args.backend}, median of {args.steps} steps"
    ]
    w = max(len(n) for n in names)
    out.append(
        "ratio: the median over steps of xgrad's step over torch's step of the same pair (the "
        "two alternate, each first in every other pair; a step's time is the slowest rank's), "
        "with the quartiles of those ratios; s/step: each one's median step"
    )
    out.append(
        f"{'schedule':<{w}} {'torch s/step':>13} {'xgrad s/step':>13} {'ratio':>7} "
        f"{'q1':>6} {'q3':>6}  target <= 1.00"
    )
    speed, simulated, memory = [], [], []
    for name in names:
        t_torch, t_ours, ratio, q1, q3 = paired(per_rank, name)
        speed.append((name, t_torch, t_ours, ratio, q1, q3, ratio <= 1.00))
        verdict = "ok" if ratio <= 1.00 else "MISSED"
        out.append(
            f"{name:<{w}} {t_torch:>13.5f} {t_ours:>13.5f} {near_limit(ratio):>7} {q1:>6.3f} {q3:>6.3f}"
            f"  {verdict}"
        )
    message = per_rank[0]["message"]
    out.append(
        "\nsimulator fed measured costs: every action of each rank in order, sends and "
        "receives included; each timed step run again from its own measured costs (every "
        "action's own time, time blocked on a message left out; every message's latency "
        "from its send's end to the wake-up of the receiver that blocked on it, none when "
        "none blocked; each rank's time between actions) plus the step's fixed setup and "
        "teardown (before the first action and after the last, to the closing barrier); "
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
        fixed = min(r[name]["pre"] for r in per_rank) + min(r[name]["post"] for r in per_rank)
        steps = [
            [res[name]["records"][k] for res in per_rank] for k in range(_count(per_rank, name))
        ]
        # Below zero (a receiver that preempted its sender) is none, as the replay takes it.
        lags = [max(0.0, x) for recs in steps for x in message_latencies(sched, recs).values()]
        latency = statistics.mean(lags) if lags else message
        pooled_step, pooled_bubble = _pooled(per_rank, name, sched, latency, fixed)
        times = [
            max(ts) for ts in zip(*(r[name].get("xgrad_steps", []) for r in per_rank), strict=True)
        ]
        if steps and len(times) == len(steps):
            replayed = replay_steps(sched, steps, times, fixed)
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
    out.append(f"\npeak memory per stage, MiB ({_memory_legend(args.backend)})")
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
    return "\n".join(out), _tables(speed, simulated, memory)


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


def paired(per_rank: list[dict[str, Any]], name: str) -> tuple[float, ...]:
    """``(torch s, xgrad s, ratio, q1, q3)``: each side's median step (a step's time is its
    slowest rank's), the median of the per-step ratios of xgrad's step to torch's in the
    same pair, and their quartiles. Pairing step by step cancels the machine's slow drift
    (both sides of a pair ran back to back); results without per-step times give the
    ratio of the medians."""
    t_torch = max(r[name]["torch"] for r in per_rank)
    t_ours = max(r[name]["xgrad"] for r in per_rank)
    if not all("torch_steps" in r[name] for r in per_rank):
        ratio = t_ours / t_torch
        return t_torch, t_ours, ratio, ratio, ratio
    theirs = [max(ts) for ts in zip(*(r[name]["torch_steps"] for r in per_rank), strict=True)]
    ours = [max(ts) for ts in zip(*(r[name]["xgrad_steps"] for r in per_rank), strict=True)]
    ratios = sorted(o / t for o, t in zip(ours, theirs, strict=True))
    if len(ratios) < 2:
        return statistics.median(theirs), statistics.median(ours), ratios[0], ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return statistics.median(theirs), statistics.median(ours), statistics.median(ratios), q1, q3


#: the columns of the three sections' tables (``--json``/``--csv``).
_SPEED = ("schedule", "torch_s", "xgrad_s", "ratio", "ratio_q1", "ratio_q3", "ok")
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


def _memory_legend(backend: str) -> str:
    """What each figure of the memory section is."""
    own = "xgrad_activation: xgrad's own count of microbatch activations and their grads held"
    if backend == "nccl":
        return f"cuda: torch.cuda.max_memory_allocated over one step; {own}"
    return (
        f"heap: C heap in use above the step's start ({HeapMeter().source}), peak polled by "
        f"a thread during the step, max of 3 steps; {own}"
    )
