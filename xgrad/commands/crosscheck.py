"""``xgrad crosscheck``: one model on every backend, gradients compared with the float64 truth."""

from __future__ import annotations

import argparse
import os
import sys
import time

from xgrad.commands.options import (
    non_negative_int,
    output_folder,
    positive_float,
    positive_int,
    size,
)
from xgrad.tables import unmakeable_folder

HELP = (
    "Run the same model on the same data with the same bucket plan through every runner of "
    "every registered backend (xgrad backends) and compare each one's reduced gradients "
    "with the float64 truth (single-process, full-batch gradients from a framework's own "
    "autograd where one is available): max abs, rel (max|g-truth|/max|truth| per "
    "parameter) and ULP distance, per parameter and per bucket, and time per step. Writes "
    "JSON and CSV; exits 1 when a backend is beyond the dtype's tolerance (float64 1e-12, "
    "float32 1e-6, float16 1e-2, bfloat16 5e-2; hooks fp16 2e-3, bf16 1.6e-2; powersgd is "
    "measured against a float64 PowerSGD model at 10x the dtype's tolerance) or fails or runs past --timeout, 3 "
    "when every backend was skipped (nothing compared: no backend available, or --device "
    "cuda without a GPU), 0 otherwise. Sizes take a unit: 2048B, 64KB, 1MB (binary; a "
    "bare --bucket-cap is in MB)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from xgrad import crosscheck, models
    from xgrad.hooks import HOOK_NAMES

    parser.add_argument(
        "--model",
        default="mlp",
        help=f"zoo model ({', '.join(models.list_models())}) or a ModelPair as package.module:NAME",
    )
    parser.add_argument("--world-size", type=positive_int, default=2, help="ranks")
    parser.add_argument("--dtype", default="float32", choices=models.DTYPES, help="model dtype")
    cap = parser.add_mutually_exclusive_group()
    cap.add_argument(
        "--bucket-cap",
        type=size("MB"),
        default=None,
        metavar="SIZE",
        help=f"cap of every bucket of the shared plan, e.g. 2048B or 1MB "
        f"(default: {crosscheck.DEFAULT_CAP_BYTES}B)",
    )
    cap.add_argument(
        "--bucket-cap-bytes",
        dest="bucket_cap",
        type=size("B"),
        metavar="SIZE",
        help="the same, a bare number in bytes (default: --bucket-cap's)",
    )
    parser.add_argument(
        "--hook",
        default="none",
        choices=["none", *HOOK_NAMES],
        help="comm hook (none: sum, then divide by the world size)",
    )
    parser.add_argument("--batch-per-rank", type=positive_int, default=4, help="samples per rank")
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="seeds the weights and the batch"
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=5,
        help="timed steps per backend (a DDP's bucket rebuild, its first, untimed where more run)",
    )
    default = crosscheck.runner_names()
    every = crosscheck.runner_entries(check=False, every=True)
    named_only = sorted(
        {e.backend for e in every} - {e.backend for e in crosscheck.runner_entries(check=False)}
    )
    parser.add_argument(
        "--backends",
        default=",".join(default),
        help="comma-separated registered backends (all their runners) or runners: "
        f"{', '.join(dict.fromkeys(e.backend for e in every))} or "
        f"{', '.join(e.name for e in every)}"
        + (f" ({', '.join(named_only)} only when named)" if named_only else ""),
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=120.0,
        help="seconds each runner's run (its warm-up and timed steps) may take, not counting "
        "the float64 truth; a runner in this process (reference, JAX) cannot be stopped part "
        "way, so it runs to its end and is reported as timed out, unmeasured, when it took "
        "longer; torch's processes are stopped at the limit",
    )
    parser.add_argument(
        "--out", type=output_folder, default="xgrad-out", help="folder for the JSON and CSV"
    )
    parser.add_argument(
        "--jax-processes",
        type=positive_int,
        default=1,
        help="run the JAX rows in this many processes (jax.distributed over gloo on "
        "127.0.0.1, each passing its own rows of the batch; default 1)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (gloo), or cuda: torch on NCCL with one process per GPU and JAX on the same "
        "GPUs (its preallocation off), each compared with its own CPU run (default cpu)",
    )
    parser.add_argument(
        "--stateful",
        action="store_true",
        help="with --hook powersgd: PyTorch's default PowerSGD state (error feedback, warm "
        "start, from the third step) carried over every step; compare the last",
    )
    parser.add_argument("--no-buckets", action="store_true", help="omit the per-bucket rows")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar or lines on stderr"
    )


def run(args: argparse.Namespace) -> int:
    from xgrad import crosscheck

    if args.device == "cuda":
        # JAX shares the GPUs with torch's ranks: it must not grab most of their memory.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    start = time.perf_counter()
    why = unmakeable_folder(args.out)  # before the run, which it would otherwise cost
    if why is not None:
        print(f"xgrad crosscheck: error: argument --out: {why}", file=sys.stderr)
        return 2
    try:
        case = crosscheck.Case(
            model=args.model,
            world_size=args.world_size,
            dtype=args.dtype,
            bucket_cap_bytes=args.bucket_cap or crosscheck.DEFAULT_CAP_BYTES,
            hook=None if args.hook == "none" else args.hook,
            batch_per_rank=args.batch_per_rank,
            seed=args.seed,
            steps=args.steps,
            timeout=args.timeout,
            stateful=args.stateful,
            jax_processes=args.jax_processes,
            device=args.device,
        )
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        if not backends:
            raise ValueError(f"--backends {args.backends!r} names no backend")
        report = crosscheck.run_crosscheck(
            case, backends=backends, progress=None if args.no_progress else sys.stderr
        )
    except crosscheck.WorldSizeError as err:
        print(
            f"xgrad crosscheck: error: argument --world-size: {err.world_size} is more than "
            f"{err.runner} takes (at most {err.limit}: {err.why}); give fewer, or leave "
            f"{err.runner} out of --backends",
            file=sys.stderr,
        )
        return 2
    except ValueError as err:
        print(f"xgrad crosscheck: error: {err}", file=sys.stderr)
        return 2
    except MemoryError as err:
        # The whole batch (and the float64 truth over it) is made in this process before
        # any backend runs: a batch too large for memory was a page of NumPy traceback.
        print(
            f"xgrad crosscheck: error: --world-size {args.world_size} x --batch-per-rank "
            f"{args.batch_per_rank} = {args.world_size * args.batch_per_rank} samples of "
            f"{args.model!r} do not fit in memory ({err or 'MemoryError'}); give fewer",
            file=sys.stderr,
        )
        return 2
    print(crosscheck.format_report(report, per_bucket=not args.no_buckets))
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = crosscheck.write_outputs(report, args.out)
    print(f"wrote {json_path} and {csv_path} ({time.perf_counter() - start:.1f} s in all)")
    if not report.ok:
        return 1
    # Nothing compared is no pass: a script or CI job that runs the crosscheck (say under
    # --device cuda on a machine without a GPU) must not take it for one.
    return 3 if report.nothing_ran else 0
