"""``xgrad plan``: print the bucket plan for a zoo model or a JSON list of sizes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from xgrad.buckets import BucketPlan, ddp_initial_plan, rebuild_plan

HELP = (
    "Print the bucket plan DDP would use, for a built-in model or a JSON list of byte sizes. "
    "'rebuilt' (default) is the plan after the first iteration, from the usual ready order "
    "(parameters in reverse definition order); 'initial' is the plan DDP starts with."
)

MIB = 1024 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="mlp", help="a zoo model (xgrad.models); default mlp")
    source.add_argument(
        "--sizes",
        help="JSON: a list of byte sizes, or an object name -> bytes; a file path or inline text",
    )
    parser.add_argument("--dtype", default="float32", help="the model's dtype (with --model)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--first-bucket-cap-mb", type=float, default=1.0)
    parser.add_argument("--mode", choices=("rebuilt", "initial"), default="rebuilt")
    parser.add_argument(
        "--find-unused-parameters",
        action="store_true",
        help="with --mode initial: DDP then buckets from the start instead of one bucket",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead")
    parser.add_argument("--out", type=Path, help="also write the plan's JSON to this file")


def _load_sizes(text: str) -> tuple[list[str], list[int]]:
    path = Path(text)
    raw = path.read_text() if path.is_file() else text
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"--sizes is neither a file nor JSON: {text[:60]!r} ({err})") from None
    if isinstance(data, dict):
        return [str(k) for k in data], [int(v) for v in data.values()]
    if isinstance(data, list):
        return [str(i) for i in range(len(data))], [int(v) for v in data]
    raise ValueError(f"--sizes must be a JSON list or object, got {type(data).__name__}")


def _model_sizes(name: str, dtype: str) -> tuple[list[str], list[int]]:
    import numpy as np

    from xgrad.models import as_dtype, get_spec

    itemsize = as_dtype(dtype).itemsize
    spec = get_spec(name)
    return [n for n, _ in spec.params], [int(np.prod(s)) * itemsize for _, s in spec.params]


def make_plan(args: argparse.Namespace) -> tuple[list[str], list[int], BucketPlan]:
    names, sizes = _load_sizes(args.sizes) if args.sizes else _model_sizes(args.model, args.dtype)
    cap = int(args.bucket_cap_mb * MIB)
    first = int(args.first_bucket_cap_mb * MIB)
    if args.mode == "initial":
        plan = ddp_initial_plan(
            sizes,
            bucket_cap_bytes=cap,
            first_bucket_cap_bytes=first,
            find_unused_parameters=args.find_unused_parameters,
        )
    else:
        order = list(reversed(range(len(sizes))))
        plan = rebuild_plan(sizes, order, bucket_cap_bytes=cap, first_bucket_cap_bytes=first)
    return names, sizes, plan


def run(args: argparse.Namespace) -> int:
    try:
        names, sizes, plan = make_plan(args)
    except ValueError as err:
        print(f"xgrad plan: {err}", file=sys.stderr)
        return 2
    if args.out:
        args.out.write_text(plan.to_json() + "\n")
    if args.json:
        print(plan.to_json())
        return 0
    source = f"sizes {args.sizes}" if args.sizes else f"model {args.model} ({args.dtype})"
    print(
        f"{args.mode} plan for {source}: {len(names)} parameters, {sum(sizes)} bytes, "
        f"{len(plan.buckets)} buckets, digest {plan.digest()[:16]}"
    )
    print(plan.table(sizes, names))
    return 0
