"""``xgrad bench jax``: bucketed vs leaf-by-leaf reduction in JAX, and JAX vs torch per step.

For one zoo model and world size, the same data-parallel step (forward, backward, gradient
reduction) runs under ``jax.shard_map`` and ``jax.pmap``, once reducing per bucket of the
shared plan and once leaf by leaf; PyTorch's own DDP and xgrad's torch DDP run the same
model on gloo processes. Printed side by side: median time per step, the bucketed /
leaf-by-leaf ratio, and each JAX mode's ratio to PyTorch's DDP.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from xgrad import models as zoo
from xgrad.backend import runner_entries
from xgrad.buckets import MAX_BUCKET_BYTES
from xgrad.progress import progress
from xgrad.step import Step, make_step
from xgrad.tables import Table, add_table_outputs, print_tables

HELP = "JAX: bucketed vs leaf-by-leaf reduction, and JAX vs torch step time (ratios)"

#: the torch runners (from the registry) this bench compares with, and their labels.
TORCH_RUNNERS: dict[str, str] = {"torch-ddp": "torch DDP", "torch-xgrad": "xgrad torch DDP"}


@dataclass(frozen=True)
class BenchCase:
    """What the bench runs: a zoo model's seeded step, bucketed with a byte cap."""

    model: str = "mlp"
    world_size: int = 2
    dtype: str = "float32"
    bucket_cap_bytes: int = 2048
    batch_per_rank: int = 4
    steps: int = 30

    def __post_init__(self) -> None:
        zoo.get_spec(self.model)
        for label in ("world_size", "bucket_cap_bytes", "batch_per_rank", "steps"):
            value = getattr(self, label)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{label.replace('_', '-')} {value!r}: expected an integer >= 1")
        if self.bucket_cap_bytes > MAX_BUCKET_BYTES:  # the torch side keeps caps in int64
            raise ValueError(f"--bucket-cap-bytes {self.bucket_cap_bytes}: at most 2**63 - 1 bytes")

    def step(self) -> Step:
        return make_step(
            self.model,
            world_size=self.world_size,
            dtype=self.dtype,
            bucket_cap_bytes=self.bucket_cap_bytes,
            batch_per_rank=self.batch_per_rank,
            steps=self.steps,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="mlp",
        help=f"zoo model ({', '.join(zoo.list_models())}) or a ModelPair as package.module:NAME",
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument(
        "--bucket-cap-bytes", type=int, default=2048, help="plan's cap in bytes (default 2048)"
    )
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--no-torch", action="store_true", help="JAX variants only")
    add_table_outputs(parser, "the times (variant, ms per step, the case's settings)")


def time_steps(step: Callable[[], Any], steps: int) -> float:
    """Median seconds of ``step()`` over ``steps`` calls, after one untimed warm-up call."""
    import jax

    jax.block_until_ready(step())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def jax_times(case: BenchCase, steps: int) -> dict[str, float]:
    """Median step time of each JAX variant: ``{"shard_map bucketed": s, ...}``."""
    from xgrad.jax_backend.crosscheck import cpu_devices

    devices = cpu_devices(case.world_size)
    from xgrad.jax_backend import models as jm
    from xgrad.jax_backend.data_parallel import data_parallel_value_and_grad

    inputs = case.step()
    params = jm.to_params(inputs.weights)
    loss = jm.make_loss(jm.get_apply(case.model))
    out = {}
    variants = [
        (mode, label, plan)
        for mode in ("shard_map", "pmap")
        for label, plan in (("bucketed", inputs.plan), ("leaf-by-leaf", None))
    ]
    for mode, label, plan in progress(variants, "bench jax"):
        step = data_parallel_value_and_grad(
            loss,
            world_size=case.world_size,
            plan=plan,
            names=list(inputs.weights),
            mode=mode,
            devices=devices,
        )
        out[f"{mode} {label}"] = time_steps(
            functools.partial(step, params, inputs.x, inputs.y), steps
        )
    return out


def torch_times(case: BenchCase) -> dict[str, float]:
    """Seconds per step of PyTorch's DDP and xgrad's torch DDP on gloo processes.

    These are the registry's torch runners, the crosscheck's too, so the bench times
    exactly what the crosscheck compares (``case.steps`` timed steps after a warm-up).
    Empty when the registry has no such runner or it cannot run here.
    """
    step = case.step()
    out = {}
    for entry in runner_entries():
        if entry.runner is not None and entry.name in TORCH_RUNNERS and not entry.unavailable:
            out[TORCH_RUNNERS[entry.name]] = entry.runner.run(step).seconds_per_step
    return dict(sorted(out.items(), key=lambda kv: list(TORCH_RUNNERS.values()).index(kv[0])))


def format_table(case: BenchCase, jax_s: dict[str, float], torch_s: dict[str, float]) -> str:
    """The side-by-side table of times and ratios."""
    plan = case.step().plan
    lines = [
        f"xgrad bench jax: {case.model}, world size {case.world_size}, {case.dtype}, "
        f"{len(plan.buckets)} buckets of <= {case.bucket_cap_bytes} B vs "
        f"{plan.num_params} leaves, batch {case.world_size}x{case.batch_per_rank}",
        "",
        f"  {'JAX mode':<10} {'bucketed ms':>12} {'leafwise ms':>12} {'bucketed/leafwise':>18}"
        + (f" {'bucketed/torch DDP':>19}" if "torch DDP" in torch_s else ""),
    ]
    for mode in ("shard_map", "pmap"):
        bucketed = jax_s[f"{mode} bucketed"]
        leafwise = jax_s[f"{mode} leaf-by-leaf"]
        row = f"  {mode:<10} {bucketed * 1e3:>12.3f} {leafwise * 1e3:>12.3f} {bucketed / leafwise:>18.2f}"
        if "torch DDP" in torch_s:
            row += f" {bucketed / torch_s['torch DDP']:>19.2f}"
        lines.append(row)
    if torch_s:
        lines.append("")
        for label, seconds in torch_s.items():
            ratio = seconds / torch_s["torch DDP"]
            lines.append(
                f"  {label:<16} {seconds * 1e3:>9.3f} ms/step  (x{ratio:.2f} of torch DDP)"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        case = BenchCase(
            model=args.model,
            world_size=args.world_size,
            dtype=args.dtype,
            bucket_cap_bytes=args.bucket_cap_bytes,
            batch_per_rank=args.batch_per_rank,
            steps=args.steps,
        )
    except ValueError as err:
        print(f"xgrad bench jax: {err}", file=sys.stderr)
        return 2
    print("timing JAX variants (shard_map, pmap; bucketed, leaf-by-leaf) ...", file=sys.stderr)
    jax_s = jax_times(case, args.steps)
    torch_s: dict[str, float] = {}
    if args.no_torch:
        print("torch comparison left out (--no-torch)", file=sys.stderr)
    else:
        print("timing torch DDP and xgrad torch DDP on gloo processes ...", file=sys.stderr)
        torch_s = torch_times(case)
        if "torch DDP" not in torch_s:
            print("torch comparison skipped: no torch DDP runner can run here", file=sys.stderr)
            torch_s = {}
    case_row = tuple(asdict(case).values())
    times = tuple((k, v * 1e3, *case_row) for k, v in {**jax_s, **torch_s}.items())
    columns = ("variant", "ms_per_step", *asdict(case))
    print_tables(args, [Table(columns, times, "bench jax")], format_table(case, jax_s, torch_s))
    return 0
