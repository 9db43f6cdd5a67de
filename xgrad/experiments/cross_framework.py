"""Torch against JAX on the zoo models: gradient difference per bucket, time per step.

The same weights, batch and bucket plan go through xgrad's DDP on torch (two gloo
processes) and xgrad's data-parallel JAX under ``shard_map`` (two CPU devices), via the
crosscheck's runners. Each bucket's reduced gradient is compared with the float64
full-batch reference (``rel``: largest error over the largest reference value) and with
the other framework's. The prediction: both are correct to float32 rounding (relative
error a small multiple of 2^-24 times the reduction depth), so they differ from each
other by no more than that either.
"""

from __future__ import annotations

import argparse

import numpy as np

from xgrad.experiments.progress import progress
from xgrad.experiments.report import Panel, Report, Series, Table, Verdict

HELP = "torch against JAX on the zoo models: gradient difference per bucket and time per step"
BACKENDS = ("torch",)
LINKS = ("real",)
RUNNERS = ("torch-xgrad", "jax-shard_map")
#: float32 agreement taken as "to rounding": 2^-24 times a generous reduction depth.
TOLERANCE = 2.0**-24 * 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cap", type=int, default=4096, help="bucket cap in bytes")


def run(args: argparse.Namespace) -> Report:
    from xgrad.crosscheck import Case, run_crosscheck
    from xgrad.models import list_models

    models = ["mlp"] if args.quick else list_models()
    rows = []
    skipped = []
    for model in progress(models, "cross-framework"):
        case = Case(
            model=model, bucket_cap_bytes=args.cap, seed=args.seed, steps=2 if args.quick else 5
        )
        rep = run_crosscheck(case, backends=list(RUNNERS))
        by = {b.name: b for b in rep.backends}
        if any(by[r].status != "ok" for r in RUNNERS):
            skipped.append(
                f"{model}: " + "; ".join(f"{r} {by[r].status} {by[r].reason}" for r in RUNNERS)
            )
            continue
        t, j = by[RUNNERS[0]], by[RUNNERS[1]]
        for k, bucket in enumerate(rep.plan.buckets):
            names = [list(t.grads)[i] for i in bucket]
            diff = max(
                float(np.abs(t.grads[n].astype(np.float64) - j.grads[n]).max()) for n in names
            )
            scale = max(float(np.abs(t.grads[n]).max()) for n in names) or 1.0
            rows.append(
                (
                    model,
                    k,
                    len(bucket),
                    t.buckets[k].rel,
                    j.buckets[k].rel,
                    diff / scale,
                    round((t.seconds_per_step or 0) * 1e3, 3),
                    round((j.seconds_per_step or 0) * 1e3, 3),
                )
            )
    table = Table(
        "cross_framework",
        (
            "model",
            "bucket",
            "params",
            "torch_rel",
            "jax_rel",
            "torch_vs_jax_rel",
            "torch_ms",
            "jax_ms",
        ),
        tuple(rows),
    )
    worst = max((max(r[3], r[4], r[5]) for r in rows), default=float("nan"))
    verdicts = (
        Verdict(
            "torch and JAX reduce the same gradients to float32 rounding",
            "xgrad's design: same plan, same data, any framework",
            f"relative difference <= {TOLERANCE:.1e} per bucket",
            f"worst {worst:.2e} over {len(rows)} buckets",
            bool(rows) and worst <= TOLERANCE,
            f"{worst:.1e} against {TOLERANCE:.1e}",
            "both sum two float32 shards per element; the kernels (BLAS vs XLA) round the "
            "matrix products differently, which is what is left",
        ),
    )
    panels = []
    for model in models:
        sub = [r for r in rows if r[0] == model]
        if not sub:
            continue
        x = tuple(float(r[1]) for r in sub)
        panels.append(
            Panel(
                f"{model}: error per bucket",
                "bucket",
                "relative error",
                (
                    Series("torch vs float64", x, tuple(r[3] for r in sub)),
                    Series("jax vs float64", x, tuple(r[4] for r in sub)),
                    Series("torch vs jax", x, tuple(r[5] for r in sub)),
                ),
                logy=True,
            )
        )
    return Report(
        name="cross-framework",
        title="torch (xgrad DDP, gloo) against JAX (shard_map) on the zoo models, float32",
        link="real loopback gloo for torch; XLA collectives between CPU devices for JAX",
        backend="torch + jax",
        config={"models": models, "cap": args.cap, "seed": args.seed},
        tables=(table,),
        panels=tuple(panels),
        verdicts=verdicts,
        notes=tuple(f"skipped {s}" for s in skipped),
    )
