"""``xgrad bench ddp``: xgrad's DDP against PyTorch's, same model and data, ratios printed.

Both run in the same processes of one gloo group, alternating step by step so that
load on the machine hits both alike, and each case runs in several launches of fresh
processes (``--launches``), since what one launch draws moves the ratio more than its
interval says. Reported per model and per ``find_unused_parameters`` setting (and with
``--join`` inside each side's own ``join()``, inputs even: what ``join()`` costs a step
while no rank has joined): median step time of each side (zero_grad, forward, backward,
optimizer step); the time ratio, the median of the per-turn ratios xgrad step
/ PyTorch step with its 95% interval and each launch's own, judged launch by launch
(``xgrad.bench_stats``); the CPU of the whole process
per step (every thread), since a faster step may be bought with CPU; memory (bytes allocated by
DDP's construction plus the peak of one step above its start, from the C allocator,
polled by a thread during the step), and xgrad's Python cost per gradient hook.
``--device cuda`` runs the same on NCCL, rank r on ``cuda:r`` (:mod:`.ddp_bench_device`).
What each rank runs and measures is :mod:`.ddp_bench_rank`; this module is the command:
its options, the launches and the table."""

from __future__ import annotations

import argparse

from xgrad.bench_stats import interval_label, rule
from xgrad.tables import add_table_outputs, print_tables
from xgrad.torch_backend.ddp_bench_device import BACKENDS, DEVICES, LABELS, check_worlds
from xgrad.torch_backend.ddp_bench_models import MODELS
from xgrad.torch_backend.ddp_bench_rank import bench_rank
from xgrad.torch_backend.ddp_bench_rows import CaseSample, pooled, rows_table, table
from xgrad.torch_backend.spawn import spawn

HELP = "xgrad's DDP vs PyTorch's DDP (gloo, CPU; or NCCL, CUDA): step time and memory ratios"

#: timed (rounds, iterations per round) and warm-up steps when not given, per scale.
_STEPS = {"full": (18, 10, 4), "tiny": (2, 3, 1)}

#: launches of fresh processes per case when not given, per scale; the rounds are split
#: between them (``xgrad.bench_stats``: why one launch cannot judge a row, and why six
#: launches are the fewest whose medians get an interval of their own).
_LAUNCHES = {"full": 6, "tiny": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="ranks")
    parser.add_argument(
        "--wide-world-size",
        type=int,
        help="also run the first model at this world size (0: no such row; "
        "default 4 on cpu, 0 on cuda)",
    )
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}"
    )
    parser.add_argument(
        "--rounds", type=int, help="alternations per case, over all launches (full 18, tiny 2)"
    )
    parser.add_argument(
        "--launches",
        type=int,
        help="runs of fresh processes per case, the rounds split between them (full 6, tiny 1); "
        "from 6 on the verdict judges the interval of the launches' medians",
    )
    parser.add_argument(
        "--iters", type=int, help="timed steps per round and side (full 10, tiny 3)"
    )
    parser.add_argument("--warmup", type=int, help="untimed steps per side (full 4, tiny 1)")
    parser.add_argument(
        "--scale", choices=("full", "tiny"), default="full", help="tiny: a smoke run"
    )
    parser.add_argument(
        "--find-unused",
        choices=("both", "no", "yes"),
        default="both",
        help="the find_unused_parameters settings to run (the wide row: no)",
    )
    parser.add_argument(
        "--join",
        choices=("no", "yes", "both"),
        default="no",
        help="run both sides' steps inside their DDP's join() (even inputs: what join() "
        "costs a step while no rank has joined); rows 'model, join' (the wide row: no)",
    )
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cuda: NCCL, rank r on cuda:r (--world-size at most the GPUs; 1 allowed)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the run")
    add_table_outputs(parser, "the rows (seconds, bytes, ratios)")


def run(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if not models:
        raise ValueError(f"--models {args.models!r} names no model; expected some of {MODELS}")
    if unknown:
        raise ValueError(f"--models: unknown model(s) {unknown}; expected some of {MODELS}")
    world, wide_world = check_worlds(args.device, args.world_size, args.wide_world_size)
    for label, least in (
        ("rounds", 1),
        ("launches", 1),
        ("iters", 1),
        ("warmup", 0),
        ("threads", 1),
    ):
        value = getattr(args, label)
        if value is not None and value < least:
            raise ValueError(f"--{label.replace('_', '-')} must be at least {least}, got {value}")
    rounds, iters, warmup = _STEPS[args.scale]
    rounds = rounds if args.rounds is None else args.rounds
    launches = _LAUNCHES[args.scale] if args.launches is None else args.launches
    if launches > rounds:
        raise ValueError(
            f"--launches {launches} needs at least as many rounds to split, got --rounds {rounds}"
        )
    settings = {
        "models": models,
        "iters": iters if args.iters is None else args.iters,
        "warmup": warmup if args.warmup is None else args.warmup,
        "scale": args.scale,
        "device": args.device,
        "find_unused": {"both": (False, True), "no": (False,), "yes": (True,)}[args.find_unused],
        "join": {"both": (False, True), "no": (False,), "yes": (True,)}[args.join],
    }
    wide = settings | {"models": models[:1], "find_unused": (False,), "join": (False,)}
    runs = [(world, settings)]
    if wide_world:
        runs.append((wide_world, wide))
    samples: dict[tuple[int, tuple[str, bool, int], bool], list[CaseSample]] = {}
    # Launch after launch, every world size in each, so a slow spell of the machine
    # falls on one launch of many cases rather than on every launch of one case.
    for k in range(launches):
        share = {"rounds": rounds // launches + (k < rounds % launches)}
        for j, (world, case_settings) in enumerate(runs):
            for row in spawn(
                bench_rank,
                world,
                args=(case_settings | share,),
                backend=BACKENDS[args.device],
                timeout=args.timeout,
                num_threads=args.threads,
            )[0]:
                sample = CaseSample(**row)
                samples.setdefault((j, sample.case, sample.join), []).append(sample)
    results = [pooled(group) for group in samples.values()]
    steps = sorted({r.steps for r in results})
    turns = min((r.turns for r in results if r.turns), default=None)
    pooled_n = min((r.pooled_turns for r in results if r.pooled_turns), default=0)
    head = (
        f"xgrad DDP vs torch DDP: {LABELS[args.device]}, {args.threads} thread(s) per rank, "
        f"median of {'/'.join(map(str, steps))} timed steps per side over {launches} launch(es) of "
        "fresh processes (each step alternated with the other side and with the bare "
        "model); time ratio = median over those turns of xgrad step / torch step in the "
        f"same turn [{interval_label(pooled_n)} of that "
        f"median]; launches = each launch's own median; target: ratio <= 1.00, "
        f"{rule(launches, turns=turns)}; CPU ratio = median CPU of the whole "
        "process per xgrad step / per torch step; µs/grad = (DDP step - bare step) / tensors"
    )
    print_tables(args, [rows_table(results)], head + "\n" + table(results))
    return 0
