"""``xgrad bench pipeline``'s options and their checks, all made before any process starts.

Kept apart from the measuring (:mod:`~xgrad.torch_backend.pipeline_bench`): this part
imports neither torch nor the runtime, so a bad option is refused at once.
"""

from __future__ import annotations

import argparse

import xgrad.pipeline as xp
from xgrad.tables import add_table_outputs

__all__ = ["TORCH_SCHEDULES", "add_arguments", "check_args"]

#: xgrad schedule name -> torch.distributed.pipelining class name (tests compare by it too).
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "looped_bfs": "ScheduleLoopedBFS",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", "-p", type=int, default=2, help="p: pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=int, default=8, help="m: microbatches")
    parser.add_argument("--batch", type=int, default=256, help="whole batch size")
    parser.add_argument("--width", type=int, default=512, help="hidden width")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers per stage")
    parser.add_argument(
        "--steps",
        type=int,
        default=60,
        help="timed steps per schedule, over all launches (by default 10 per launch: a launch's "
        "95%% interval is then its 2nd to 9th ratio; under 6 steps it is their whole range)",
    )
    parser.add_argument(
        "--launches",
        type=int,
        default=6,
        help="runs of fresh processes, the steps split between them, since a launch's steps "
        "share what it drew: from 6 on the verdict judges the interval of the launches' "
        "medians, with fewer it needs every launch's own interval to agree",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, per launch")
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default="gloo", help="gloo (CPU) or nccl (GPU)"
    )
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (CPU)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for each launch")
    parser.add_argument(
        "--schedules",
        default=",".join(TORCH_SCHEDULES),
        help="comma-separated schedules to run (default: every one both implement)",
    )
    add_table_outputs(parser, "the three sections (seconds, fractions, bytes)")


def _check_batch(batch: int, m: int) -> None:
    """Refuse a ``--batch`` that m does not divide, saying why, before any process starts.

    xgrad's runtime splits it as ``tensor_split`` does, but torch's stages cannot run it
    across ranks, so there would be nothing to compare: torch 2.13's ``PipelineStage``
    sizes every receive from microbatch 0, and each of the seven schedules failed at p = 2,
    m = 4, --batch 10 with "The size of tensor a (3) must match the size of tensor b (2)"
    on one rank and a closed connection on the other.

    Raises:
        ValueError: naming --batch, --microbatches and the sizes it would split into.
    """
    if batch < m:
        raise ValueError(
            f"--batch {batch} is smaller than --microbatches {m}: every microbatch needs at "
            "least one row"
        )
    q, extra = divmod(batch, m)
    if extra:
        raise ValueError(
            f"--batch {batch} is not a multiple of --microbatches {m} ({extra} microbatches "
            f"of {q + 1} rows, {m - extra} of {q}): torch.distributed.pipelining cannot run "
            "uneven microbatches across ranks (its stages size every receive from "
            "microbatch 0, and a smaller one fails), so the bench would have nothing to "
            f"compare xgrad's runtime with; give a multiple of {m}, such as {q * m} or "
            f"{(q + 1) * m}"
        )


def check_args(args: argparse.Namespace) -> list[str]:
    """The schedules to run, once every option is checked.

    Raises:
        ValueError: naming the option and its value.
    """
    p, m = args.stages, args.microbatches
    for label, value in (
        ("stages", p),
        ("microbatches", m),
        ("steps", args.steps),
        ("launches", args.launches),
    ):
        if value < 1:
            raise ValueError(f"--{label} must be >= 1, got {value}")
    if args.launches > args.steps:
        raise ValueError(
            f"--launches {args.launches} needs at least as many steps to split, got "
            f"--steps {args.steps}"
        )
    if p < 2:
        raise ValueError(f"--stages must be >= 2 for a pipeline, got {p}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    for label in ("batch", "width", "layers", "threads", "timeout"):
        if not getattr(args, label) > 0:
            raise ValueError(f"--{label} must be > 0, got {getattr(args, label)}")
    _check_batch(args.batch, m)
    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    unknown = [n for n in names if n not in TORCH_SCHEDULES]
    if unknown or not names:
        raise ValueError(
            f"--schedules {args.schedules!r}: {unknown or 'none given'}; choose from {', '.join(TORCH_SCHEDULES)}"
        )
    for name in names:
        xp.make(name, p, m)  # a bad (p, m) for a schedule is refused here, before spawning
    return names
