"""``xgrad schedule NAME``: print a pipeline schedule's grid and its simulated figures."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from xgrad.commands.options import output_file, positive_int
from xgrad.tables import Table, write_tables

HELP = (
    "print a pipeline schedule as a rank × step grid with its simulated step time, bubble "
    "fraction and activations held; optionally save the timeline as a PNG or the schedule "
    "as PyTorch pipelining's CSV"
)


def _costs(text: str) -> dict[str, float]:
    """Parse ``F=1,B=2`` into a dict (argparse type)."""
    out: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--costs item {item!r} is not KIND=NUMBER")
        try:
            cost = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--costs value {value!r} is not a number") from None
        if not math.isfinite(cost) or cost < 0:
            raise argparse.ArgumentTypeError(
                f"--costs value {value!r} for {key.strip()!r}: expected a finite number >= 0"
            )
        out[key.strip().upper()] = cost
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from xgrad.pipeline import SCHEDULES
    from xgrad.pipeline.multistage import MULTISTAGE

    parser.add_argument("name", choices=sorted(SCHEDULES), help="which schedule")
    parser.add_argument(
        "--stages", "-p", type=positive_int, required=True, help="p: pipeline ranks"
    )
    parser.add_argument(
        "--microbatches", "-m", type=positive_int, required=True, help="m: microbatches"
    )
    parser.add_argument(
        "--chunks",
        "-v",
        type=positive_int,
        default=2,
        help=(
            f"v: chunks (stages) per rank, for the multi-stage schedules ({', '.join(MULTISTAGE)}"
            "; zbv and dualpipev take 2 only); the others place one stage per rank"
        ),
    )
    parser.add_argument(
        "--costs",
        type=_costs,
        default=None,
        help=(
            "per-kind costs, e.g. F=1,B=2,I=1,W=1 (default: equal, B = I + W); a schedule "
            "with both full (B) and split (I, W) backwards, as dualpipev, needs B = I + W"
        ),
    )
    parser.add_argument("--comms", action="store_true", help="show the sends and receives")
    parser.add_argument("--timeline", action="store_true", help="also print the time grid")
    parser.add_argument(
        "--png", type=output_file, metavar="FILE", help="save the timeline as a PNG"
    )
    parser.add_argument(
        "--csv",
        type=output_file,
        metavar="FILE",
        help="save the schedule as a CSV file (PyTorch pipelining's format)",
    )
    parser.add_argument(
        "--json",
        type=output_file,
        metavar="FILE",
        help="save the simulated figures, per-rank figures and timeline as JSON",
    )


def run(args: argparse.Namespace) -> int:
    import xgrad.pipeline as xp
    from xgrad.pipeline.plot import save_timeline_png

    try:
        schedule = xp.make(args.name, args.stages, args.microbatches, chunks=args.chunks)
        costs = None
        if args.costs is not None:
            costs = dict(xp.DEFAULT_COSTS)
            for key, value in args.costs.items():
                kind = {
                    k.value: k for k in xp.Kind if k.is_compute and k is not xp.Kind.OVERLAP_F_B
                }.get(key)
                if kind is None:
                    raise ValueError(f"--costs kind {key!r} is not one of F, B, I, W")
                costs[kind] = value
            _check_backwards(schedule, costs)
        sim = xp.simulate(schedule, costs)
    except ValueError as exc:
        print(f"xgrad schedule: error: {exc}", file=sys.stderr)
        return 2
    shown = xp.validate(xp.insert_comms(schedule)) if args.comms else schedule
    print(f"{schedule.name}: p={schedule.num_ranks} m={schedule.num_microbatches}")
    print(shown.grid(), end="")
    print()
    if args.timeline:
        print(sim.grid(), end="")
        print()
    print(sim.summary(), end="")
    if args.csv:
        # With comms, the file is torch's lowering (REDUCE_GRAD and the FSDP actions too), as
        # torch's _dump_csv writes it: without REDUCE_GRAD torch's runtime never scales the
        # gradients by 1/m.
        written = xp.validate(xp.insert_comms(xp.add_stage_ops(schedule))) if args.comms else shown
        xp.dump_csv(written, args.csv)
        print(f"CSV written to {args.csv}")
    if args.json:
        write_tables(simulation_tables(sim), args.json, None)
        print(f"JSON written to {args.json}")
    if args.png:
        try:
            save_timeline_png(
                sim, args.png, name=f"{schedule.name} p={args.stages} m={args.microbatches}"
            )
        except RuntimeError as exc:
            print(f"xgrad schedule: error: {exc}", file=sys.stderr)
            return 2
        print(f"PNG written to {args.png}")
    return 0


def _check_backwards(schedule: Any, costs: dict[Any, float]) -> None:
    """Refuse ``--costs`` with B != I + W for a schedule that runs both a full backward
    (B) and split ones (I, W): a full backward is the same work as its two halves, and the
    simulator times each action by its kind alone, so such costs gave wrong step times and
    bubbles without a word. A schedule with one of the two alone never reads the others
    (``F=1,B=3`` stays right for 1F1B, ``I=2`` for ZB-H1).
    """
    from xgrad.pipeline import Kind

    kinds = {a.kind for r in range(schedule.num_ranks) for a in schedule.compute(r)}
    b, i, w = (costs[k] for k in (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT))
    split = {Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT} & kinds
    if Kind.BACKWARD in kinds and split and not math.isclose(b, i + w, rel_tol=1e-9):
        raise ValueError(
            f"--costs B={b:g} but I + W = {i:g} + {w:g} = {i + w:g}: {schedule.name} runs "
            f"both full backwards (B) and their halves (I, W), so B must equal I + W (a "
            f"full backward is both halves' work); give --costs B, I and W that agree"
        )


def simulation_tables(sim: Any) -> list[Table]:
    """A simulation's figures, per-rank figures and timeline as tables (for JSON)."""
    figures = Table(
        ("figure", "value"),
        (
            ("step_time", sim.step_time),
            ("makespan", sim.makespan),
            ("bubble_fraction", sim.bubble_fraction),
        ),
        "figures",
    )
    ranks = Table(
        ("rank", "busy", "peak_held"),
        tuple((r, b, h) for r, (b, h) in enumerate(zip(sim.busy, sim.peak_held, strict=True))),
        "ranks",
    )
    spans = Table(
        ("rank", "action", "start", "end"),
        tuple((s.rank, str(s.action), s.start, s.end) for row in sim.spans for s in row),
        "timeline",
    )
    return [figures, ranks, spans]
