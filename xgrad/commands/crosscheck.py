"""``xgrad crosscheck``: one model on every backend, gradients compared with a float64 reference."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HELP = (
    "Run the same model on the same data with the same bucket plan through every backend "
    "(xgrad's reference, xgrad's torch DDP and PyTorch's DDP on gloo processes, xgrad JAX "
    "under pmap and shard_map) and compare each one's reduced gradients with single-process "
    "float64 gradients: max abs, rel (max|g-ref|/max|ref| per parameter) and ULP distance, "
    "per parameter and per bucket, and time per step. Writes JSON and CSV; exits 1 when a "
    "backend is beyond the dtype's tolerance (float64 1e-12, float32 1e-6, float16 1e-2, "
    "bfloat16 5e-2; hooks fp16 2e-3, bf16 1.6e-2; powersgd is measured against a float64 "
    "PowerSGD model at 10x the dtype's tolerance) or fails, 0 otherwise."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from xgrad import crosscheck, models

    parser.add_argument(
        "--model",
        default="mlp",
        help=f"zoo model ({', '.join(models.list_models())}) or a ModelPair as package.module:NAME",
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--dtype", default="float32", choices=models.DTYPES)
    parser.add_argument(
        "--bucket-cap-bytes",
        type=int,
        default=crosscheck.DEFAULT_CAP_BYTES,
        help=f"byte cap of every bucket of the shared plan (default {crosscheck.DEFAULT_CAP_BYTES})",
    )
    parser.add_argument(
        "--hook", default="none", choices=["none", *crosscheck.CASE_HOOKS], help="comm hook"
    )
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per backend")
    names = crosscheck.runner_names()
    backends = list(dict.fromkeys(e.backend for e in crosscheck.runner_entries(check=False)))
    parser.add_argument(
        "--backends",
        default=",".join(names),
        help=f"comma-separated registered backends ({', '.join(backends)}: all their runners) "
        f"or runners ({', '.join(names)}); default all",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per torch run")
    parser.add_argument(
        "--jax-processes",
        type=int,
        default=1,
        help="run the JAX rows in this many processes (jax.distributed over gloo on "
        "127.0.0.1, each passing its own rows of the batch; default 1)",
    )
    parser.add_argument(
        "--stateful",
        action="store_true",
        help="with --hook powersgd: PyTorch's default PowerSGD state (error feedback, warm "
        "start, from the third step) carried over every step; compare the last",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("xgrad-out"), help="folder for the JSON and CSV"
    )
    parser.add_argument("--no-buckets", action="store_true", help="omit the per-bucket rows")


def run(args: argparse.Namespace) -> int:
    from xgrad import crosscheck

    start = time.perf_counter()
    try:
        case = crosscheck.Case(
            model=args.model,
            world_size=args.world_size,
            dtype=args.dtype,
            bucket_cap_bytes=args.bucket_cap_bytes,
            hook=None if args.hook == "none" else args.hook,
            batch_per_rank=args.batch_per_rank,
            seed=args.seed,
            steps=args.steps,
            timeout=args.timeout,
            stateful=args.stateful,
            jax_processes=args.jax_processes,
        )
        backends = [b for b in args.backends.split(",") if b]
        report = crosscheck.run_crosscheck(case, backends=backends, progress=sys.stderr)
    except ValueError as err:
        print(f"xgrad crosscheck: {err}", file=sys.stderr)
        return 2
    print(crosscheck.format_report(report, per_bucket=not args.no_buckets))
    json_path, csv_path = crosscheck.write_outputs(report, args.out)
    print(f"wrote {json_path} and {csv_path} ({time.perf_counter() - start:.1f} s in all)")
    return 0 if report.ok else 1
