"""The report of ``xgrad bench pipeline``: its three sections as text and as tables.

Kept apart from the measuring (``pipeline_bench``): this part only reads the per-rank
results, feeds the measured costs to the simulator and formats what it finds.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import xgrad.pipeline as xp
from xgrad.pipeline import Kind
from xgrad.tables import Table
from xgrad.torch_backend.memory import HeapMeter


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
        f"{'schedule':<{w}} {'torch s/step':>13} {'xgrad s/step':>13} {'ratio':>7}  target <= 1.00"
    )
    speed, simulated, memory = [], [], []
    for name in names:
        t_torch = max(r[name]["torch"] for r in per_rank)
        t_ours = max(r[name]["xgrad"] for r in per_rank)
        ratio = t_ours / t_torch
        speed.append((name, t_torch, t_ours, ratio, ratio <= 1.00))
        verdict = "ok" if ratio <= 1.00 else "MISSED"
        out.append(f"{name:<{w}} {t_torch:>13.5f} {t_ours:>13.5f} {ratio:>7.3f}  {verdict}")
    message = per_rank[0]["message"]
    out.append(
        "\nsimulator fed measured costs (median per stage and kind, sends included; per message "
        f"the median latency the runtime saw, or {message * 1e6:.0f} us from a ping-pong): "
        "step time within 10% and bubble within 3 points of measured"
    )
    out.append(
        f"{'schedule':<{w}} {'measured s':>11} {'simulated s':>12} {'error':>7}  "
        f"{'bubble measured':>15} {'simulated':>9} {'equal-cost':>10} {'msg us':>7}"
    )
    for name in names:
        step = max(r[name]["xgrad"] for r in per_rank)
        measured = 1.0 - sum(r[name]["busy"] for r in per_rank) / (p * step)
        costs = {
            (stage, Kind(kind)): c
            for res in per_rank
            for (stage, kind), c in res[name]["costs"].items()
        }
        sched = xp.make(name, p, m)

        def cost(a: Any, costs: dict[tuple[int, Any], float] = costs) -> float:
            # A pass occupies its rank while it runs and while it posts its result's send.
            send = Kind.SEND_F if a.kind is Kind.FORWARD else Kind.SEND_B
            extra = costs.get((a.stage, send), 0.0) if a.kind is not Kind.BACKWARD_WEIGHT else 0.0
            return costs[(a.stage, a.kind)] + extra

        records = [res[name]["records"] for res in per_rank]
        latency = _latency(xp.insert_comms(sched), records) or message
        sim = xp.simulate(sched, cost, comm_cost=latency)
        equal = xp.simulate(sched)
        error = sim.step_time / step - 1.0
        ok = abs(error) <= 0.10 and abs(sim.bubble_fraction - measured) <= 0.03
        figures = (step, sim.step_time, error, measured, sim.bubble_fraction)
        simulated.append((name, *figures, equal.bubble_fraction, latency * 1e6, ok))
        out.append(
            f"{name:<{w}} {step:>11.5f} {sim.step_time:>12.5f} {error:>+7.1%}  "
            f"{measured:>15.3f} {sim.bubble_fraction:>9.3f} {equal.bubble_fraction:>10.3f}"
            f" {latency * 1e6:>7.0f}  {'ok' if ok else 'MISSED'}"
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


#: the columns of the three sections' tables (``--json``/``--csv``).
_SPEED = ("schedule", "torch_s", "xgrad_s", "ratio", "ok")
_SIMULATED = (
    *("schedule", "measured_s", "simulated_s", "error", "bubble_measured"),
    *("bubble_simulated", "bubble_equal_cost", "message_us", "ok"),
)


def _tables(speed: list, simulated: list, memory: list) -> list[Table]:
    """The three sections as data (seconds, fractions, bytes), for ``--json``/``--csv``."""
    return [
        Table(_SPEED, tuple(speed), "bench pipeline"),
        Table(_SIMULATED, tuple(simulated), "simulator"),
        Table(("stage", "schedule", "figure", "bytes"), tuple(memory), "peak memory"),
    ]


def _latency(schedule: Any, records: list[list[tuple[str, float, float]]]) -> float | None:
    """Median seconds from the end of a send's posting to the end of its receive, over the
    messages whose receiver was already waiting (``time.perf_counter`` is one clock for
    every process of a machine). ``None`` when no message qualifies."""
    from xgrad.pipeline import Action
    from xgrad.pipeline.validate import comm_partners

    ends = {text: end for recs in records for text, _, end in recs}
    samples = []
    for recs in records:
        for text, start, end in recs:
            if "RECV_" not in text:
                continue
            partners = comm_partners(schedule, Action.parse(text))
            sent = [ends[str(a)] for _, a in partners if str(a) in ends]
            if sent and start <= max(sent) <= end:
                samples.append(end - max(sent))
    return statistics.median(samples) if samples else None


def _memory_legend(backend: str) -> str:
    """What each figure of the memory section is."""
    own = "xgrad_activation: xgrad's own count of microbatch activations and their grads held"
    if backend == "nccl":
        return f"cuda: torch.cuda.max_memory_allocated over one step; {own}"
    return (
        f"heap: C heap in use above the step's start ({HeapMeter().source}), peak polled by "
        f"a thread during the step, max of 3 steps; {own}"
    )
