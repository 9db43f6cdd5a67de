"""``xgrad plan``: print the bucket plan for a zoo model or a JSON list of sizes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from xgrad.buckets import NO_LIMIT, BucketPlan, ddp_bucket_caps, ddp_initial_plan, rebuild_plan
from xgrad.commands.options import add_table_outputs, output_file, size
from xgrad.tables import Table, write_tables

HELP = (
    "Print the bucket plan DDP would use, for a built-in model or a JSON list of byte sizes. "
    "'rebuilt' (default) is the plan after the first iteration, from the usual ready order "
    "(parameters in reverse definition order); 'initial' is the plan DDP starts with. "
    "Sizes take a unit: 25MB, 512KB, 2048B (K, M, G are binary, as DDP's bucket_cap_mb); "
    "a bare number is in MB."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="mlp", help="a zoo model (xgrad.models)")
    source.add_argument(
        "--sizes",
        help="JSON: a list of byte sizes, or an object name -> bytes; a file path or inline text",
    )
    parser.add_argument("--dtype", default="float32", help="the model's dtype (with --model)")
    parser.add_argument(
        "--bucket-cap",
        "--bucket-cap-mb",
        dest="bucket_cap",
        type=size("MB"),
        default=None,
        metavar="SIZE",
        help="DDP's bucket cap (bucket_cap_mb); none: 25MB, with a 1MB first bucket",
    )
    parser.add_argument(
        "--first-bucket-cap",
        "--first-bucket-cap-mb",
        dest="first_bucket_cap",
        type=size("MB"),
        default=None,
        metavar="SIZE",
        help="cap of the first bucket; none: 1MB by default, the --bucket-cap when one is "
        "given (as DDP does)",
    )
    parser.add_argument(
        "--mode", choices=("rebuilt", "initial"), default="rebuilt", help="which plan"
    )
    parser.add_argument(
        "--find-unused-parameters",
        action="store_true",
        help="with --mode initial: DDP then buckets from the start instead of one bucket",
    )
    add_table_outputs(parser, "the plan (JSON: the plan itself; CSV: its table)")
    parser.add_argument(
        "--out", type=output_file, metavar="FILE", help="also write the plan's JSON to this file"
    )


def _load_sizes(text: str) -> tuple[list[str], list[int]]:
    path = Path(text)
    raw = path.read_text() if path.is_file() else text
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"--sizes is neither a file nor JSON: {text[:60]!r} ({err})") from None
    if isinstance(data, dict):
        names, values = [str(k) for k in data], list(data.values())
    elif isinstance(data, list):
        names, values = [str(i) for i in range(len(data))], data
    else:
        raise ValueError(f"--sizes must be a JSON list or object, got {type(data).__name__}")
    for name, value in zip(names, values, strict=True):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"--sizes: size of {name!r} is {value!r}, not a whole number of bytes")
    return names, [int(v) for v in values]


def _model_sizes(name: str, dtype: str) -> tuple[list[str], list[int]]:
    import numpy as np

    from xgrad.models import as_dtype, get_spec

    itemsize = as_dtype(dtype).itemsize
    spec = get_spec(name)
    return [n for n, _ in spec.params], [int(np.prod(s)) * itemsize for _, s in spec.params]


def make_plan(args: argparse.Namespace) -> tuple[list[str], list[int], BucketPlan]:
    names, sizes = _load_sizes(args.sizes) if args.sizes else _model_sizes(args.model, args.dtype)
    first, cap = ddp_bucket_caps(args.bucket_cap, args.first_bucket_cap)
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


def plan_table(plan: BucketPlan, sizes: list[int], names: list[str]) -> Table:
    """The plan as a table (a cap of :data:`NO_LIMIT` is infinite; 0: a sparse bucket's)."""
    rows = tuple(
        (
            b,
            len(bucket),
            sum(sizes[i] for i in bucket),
            float("inf") if limit >= NO_LIMIT else limit,
            " ".join(names[i] for i in bucket),
        )
        for b, (bucket, limit) in enumerate(zip(plan.buckets, plan.limits, strict=True))
    )
    return Table(("bucket", "params", "bytes", "limit", "members"), rows, "plan")


def run(args: argparse.Namespace) -> int:
    try:
        names, sizes, plan = make_plan(args)
    except ValueError as err:
        print(f"xgrad plan: error: {err}", file=sys.stderr)
        return 2
    if args.out:
        args.out.write_text(plan.to_json() + "\n")
    if args.json is not None and str(args.json) == "-":
        print(plan.to_json())
        return 0
    if args.json is not None:
        args.json.write_text(plan.to_json() + "\n")
    if write_tables([plan_table(plan, sizes, names)], None, args.csv):
        return 0
    source = f"sizes {args.sizes}" if args.sizes else f"model {args.model} ({args.dtype})"
    print(
        f"{args.mode} plan for {source}: {len(names)} parameters, {sum(sizes)} bytes, "
        f"{len(plan.buckets)} buckets, digest {plan.digest()[:16]}"
    )
    print(plan.table(sizes, names))
    return 0
