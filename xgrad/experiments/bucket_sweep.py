"""Bucket-size sweep: iteration time of data-parallel training vs bucket cap and world size.

The paper question: small buckets start reducing early (overlap with the backward pass)
but pay the per-message latency once per bucket; one big bucket pays it once but cannot
start before the backward pass ends. Where is the sweet spot, and how does it move with
the world size? The runs are real (xgrad's engine, buckets and reducer on the reference
backend's simulated ranks, exact sums), the time is virtual: compute is charged at
``flops_per_second`` and every allreduce costs the ring formula on one shared link, so
64 ranks are timed on any machine, and the same seed and settings give the same table.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from xgrad.hooks import HOOKS
from xgrad.reference.clock import LinkModel
from xgrad.reference.comm import ReferenceComm, World, spawn
from xgrad.reference.ddp import DataParallel
from xgrad.reference.models import MLP, mlp_batch, mlp_weights

HELP = "iteration time vs bucket cap and world size on the virtual clock (alpha-beta link)"


@dataclass(frozen=True)
class SweepConfig:
    """Everything that determines a sweep's numbers.

    Attributes:
        world_sizes, bucket_caps: the grid (caps in bytes; the first bucket gets the same).
        width, layers: the MLP is ``layers`` square ``width x width`` float32 layers.
        batch_per_rank: samples per rank.
        alpha: link latency per message (s); beta: seconds per byte.
        flops_per_second: the modelled compute rate of one rank.
        iterations: iterations per point; the last one is reported (buckets are rebuilt
            from the observed gradient order after the first, as in DDP).
        hook: a communication hook from ``xgrad.hooks.HOOKS`` (``"fp16"`` halves the bytes
            on the wire), or None for DDP's default reduction.
        seed: weights and data.
    """

    world_sizes: tuple[int, ...] = (2, 8, 32, 64)
    bucket_caps: tuple[int, ...] = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
    width: int = 128
    layers: int = 32
    batch_per_rank: int = 32
    alpha: float = 5e-6
    beta: float = 1 / 10e9
    flops_per_second: float = 1e10
    iterations: int = 2
    hook: str | None = None
    seed: int = 0


@dataclass(frozen=True)
class SweepRow:
    """One point of the sweep (times in milliseconds of virtual time)."""

    world_size: int
    bucket_cap_bytes: int
    buckets: int
    compute_ms: float
    comm_ms: float
    iteration_ms: float
    exposed_comm_ms: float
    overlap_pct: float


def run_point(config: SweepConfig, world_size: int, cap: int) -> SweepRow:
    """Train ``config.iterations`` iterations on ``world_size`` ranks; time the last."""
    sizes = [config.width] * (config.layers + 1)
    weights = mlp_weights(sizes, seed=config.seed, dtype="float32")
    x, y = mlp_batch(sizes, config.batch_per_rank * world_size, seed=config.seed, dtype="float32")
    link = LinkModel(config.alpha, config.beta)
    world = World(world_size, link=link, flops_per_second=config.flops_per_second)
    clock = world.clock
    assert clock is not None

    def rank_main(comm: ReferenceComm) -> tuple[float, float, int]:
        flops = [0.0]

        def charge(n: float) -> None:
            flops[0] += n
            clock.compute(comm.rank, n)

        dp = DataParallel(
            MLP(weights, charge=charge),
            comm,
            bucket_cap_bytes=cap,
            first_bucket_cap_bytes=cap,
            hook=config.hook,
        )
        per = config.batch_per_rank
        xs, ys = (
            x[comm.rank * per : (comm.rank + 1) * per],
            y[comm.rank * per : (comm.rank + 1) * per],
        )
        start = flops_before = 0.0
        first_event = 0
        for _ in range(config.iterations):
            # Every earlier allreduce finished before this rank's last finalize returned,
            # and none of this iteration's can start before this rank launches it.
            start, flops_before, first_event = comm.now(), flops[0], len(clock.log)
            dp.zero_grad()
            dp.backward(dp.forward(xs, ys))
        return comm.now() - start, flops[0] - flops_before, first_event

    results = spawn(rank_main, world_size, world=world)
    iteration = max(r[0] for r in results)
    compute = results[0][1] / config.flops_per_second
    events = clock.log[results[0][2] :]
    comm = sum(e.finish - e.start for e in events)
    exposed = iteration - compute
    # Rounded so that float noise never prints as -0.0 for a bucket that cannot overlap.
    overlap = round(100.0 * (1.0 - exposed / comm), 9) + 0.0 if comm > 0 else 100.0
    return SweepRow(
        world_size=world_size,
        bucket_cap_bytes=cap,
        buckets=len(events),
        compute_ms=compute * 1e3,
        comm_ms=comm * 1e3,
        iteration_ms=iteration * 1e3,
        exposed_comm_ms=exposed * 1e3,
        overlap_pct=overlap,
    )


def bucket_sweep(config: SweepConfig) -> list[SweepRow]:
    """Every (world size, bucket cap) point of the grid, world sizes outermost."""
    return [run_point(config, n, cap) for n in config.world_sizes for cap in config.bucket_caps]


def format_table(rows: Sequence[SweepRow]) -> str:
    """A fixed-width text table, the best cap of each world size marked with ``*``."""
    best: dict[int, float] = {}
    for r in rows:
        best[r.world_size] = min(best.get(r.world_size, float("inf")), r.iteration_ms)
    head = (
        f"{'ranks':>5} {'cap':>9} {'buckets':>7} {'compute ms':>10} {'comm ms':>9} "
        f"{'iter ms':>9} {'exposed ms':>10} {'overlap %':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mark = "*" if r.iteration_ms == best[r.world_size] else " "
        lines.append(
            f"{r.world_size:>5} {_human(r.bucket_cap_bytes):>9} {r.buckets:>7} "
            f"{r.compute_ms:>10.3f} {r.comm_ms:>9.3f} {r.iteration_ms:>9.3f}{mark}"
            f"{r.exposed_comm_ms:>10.3f} {r.overlap_pct:>9.1f}"
        )
    return "\n".join(lines)


def _human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def write_results(rows: Sequence[SweepRow], config: SweepConfig, out: Path) -> tuple[Path, Path]:
    """``bucket_sweep.csv`` (the rows) and ``bucket_sweep.json`` (config and rows)."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / "bucket_sweep.csv", out / "bucket_sweep.json"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(SweepRow.__dataclass_fields__))
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))
    doc = {
        "experiment": "bucket_sweep",
        "config": asdict(config),
        "rows": [asdict(r) for r in rows],
    }
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    return csv_path, json_path


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of ints"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} needs positive integers")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SweepConfig()
    parser.add_argument("--world-sizes", type=_ints, default=d.world_sizes, help="e.g. 2,8,32,64")
    parser.add_argument(
        "--caps", type=_ints, default=d.bucket_caps, help="bucket caps in bytes, e.g. 65536,1048576"
    )
    parser.add_argument("--width", type=int, default=d.width, help="MLP layer width")
    parser.add_argument("--layers", type=int, default=d.layers, help="number of MLP layers")
    parser.add_argument("--batch-per-rank", type=int, default=d.batch_per_rank)
    parser.add_argument("--alpha", type=float, default=d.alpha, help="link latency (s)")
    parser.add_argument("--beta", type=float, default=d.beta, help="link seconds per byte")
    parser.add_argument("--flops", type=float, default=d.flops_per_second, help="flop/s per rank")
    parser.add_argument("--iterations", type=int, default=d.iterations)
    parser.add_argument(
        "--hook",
        choices=["none", *sorted(HOOKS)],
        default="none",
        help="communication hook (default: none)",
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--out", type=Path, default=Path("xgrad-out"), help="folder for CSV/JSON")


def run(args: argparse.Namespace) -> int:
    for name in ("width", "layers", "batch_per_rank", "iterations"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.seed < 0:  # NumPy's own error ("expected non-negative integer") names no option
        raise ValueError(f"--seed={args.seed} must be >= 0")
    config = SweepConfig(
        world_sizes=tuple(args.world_sizes),
        bucket_caps=tuple(args.caps),
        width=args.width,
        layers=args.layers,
        batch_per_rank=args.batch_per_rank,
        alpha=args.alpha,
        beta=args.beta,
        flops_per_second=args.flops,
        iterations=args.iterations,
        hook=None if args.hook == "none" else args.hook,
        seed=args.seed,
    )
    rows = bucket_sweep(config)
    model_mib = config.layers * (config.width + 1) * config.width * 4 / (1 << 20)
    print(
        f"bucket sweep: {config.layers} x {config.width}^2 float32 MLP ({model_mib:.2f} MiB), "
        f"alpha {config.alpha * 1e6:g} us, {1 / config.beta / 1e9:g} GB/s, "
        f"{config.flops_per_second:g} flop/s, hook {config.hook or 'none'}, virtual time"
    )
    print(format_table(rows))
    csv_path, json_path = write_results(rows, config, args.out)
    print(f"wrote {csv_path} and {json_path}")
    return 0
