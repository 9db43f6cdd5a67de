"""At scales this machine does not have: the alpha-beta cost model, validated, extrapolated.

First the model (:mod:`xgrad.experiments.costmodel`) predicts small runs measured here
(xgrad's DDP on 2 gloo ranks over the simulated link, compute measured without
communication), within 15%. Then, with this machine's measured flop rate (or
``--flops``) and a datacentre link, it predicts the iteration time of ResNet-50,
BERT-large and GPT-2 (parameter lists from :mod:`xgrad.experiments.architectures`) on 2
to 1024 ranks with ring and tree allreduce and 25 MiB buckets: the shape of the DDP
paper's scaling figure (Fig. 9: per-iteration latency grows with the world size, slowly
with ring allreduce).
"""

from __future__ import annotations

import argparse
from typing import Any

from xgrad.experiments import overlap
from xgrad.experiments.architectures import ARCHITECTURES
from xgrad.experiments.costmodel import ALGORITHMS, ddp_iteration
from xgrad.experiments.link import link_description
from xgrad.experiments.progress import progress
from xgrad.experiments.report import Panel, Report, Series, Table, within
from xgrad.experiments.torch_parts import spawn
from xgrad.reference.clock import LinkModel

HELP = "alpha-beta cost model: validated on small runs here, extrapolated to 1024 ranks"
BACKENDS = ("torch",)
LINKS = ("sim",)
LINK_DEFAULTS = overlap.LINK_DEFAULTS
WORLDS = tuple(2**k for k in range(1, 11))
#: samples per rank of each model (images; sequences).
BATCH = {"resnet50": 32, "bert-large": 8, "gpt2": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flops", type=float, default=0.0, help="flop/s per rank (0: measured)")
    parser.add_argument("--target-alpha", type=float, default=5e-6, help="extrapolation alpha (s)")
    parser.add_argument("--target-gbps", type=float, default=12.5, help="extrapolation GB/s")


def run(args: argparse.Namespace) -> Report:
    link = LinkModel(args.alpha, args.beta)
    sizes = ((4, 512),) if args.quick else ((4, 512), (8, 512))
    rows = []
    rate = []
    for layers, width in progress(sizes, "scaling: validation runs"):
        cfg = {
            "width": width,
            "layers": layers,
            "batch": 128,
            "cap_mb": 1.0,
            "link": "sim",
            "alpha": args.alpha,
            "beta": args.beta,
            "seed": args.seed,
            "steps": 3 if args.quick else 8,
        }
        per_rank: list[dict[str, Any]] = spawn(overlap._worker, 2, (cfg,), timeout=600)
        t = {m: max(r[m]["total"] for r in per_rank) for m in overlap.MODES}
        fwd = max(r["no_comm"]["forward"] for r in per_rank)
        lb = list(reversed(per_rank[0]["layer_bytes"]))
        bwd = t["no_comm"] - fwd
        per_layer = [bwd * b / sum(lb) for b in lb]
        pred = ddp_iteration(
            fwd, per_layer, lb, 1 << 20, lambda b: link.allreduce_seconds(int(b), 2)
        )
        rows.append(
            (
                f"{layers} x {width}^2",
                round(pred.iteration * 1e3, 3),
                round(t["overlap"] * 1e3, 3),
                round(100 * (t["overlap"] / pred.iteration - 1), 1),
            )
        )
        rate.append(3 * 2.0 * 128 * width * width * layers / t["no_comm"])
    flops = args.flops or min(rate)
    target = LinkModel(args.target_alpha, 1 / (args.target_gbps * 1e9))
    ext = []
    series = []
    for name, build in ARCHITECTURES.items():
        layers_ = list(reversed(build()))
        b = BATCH[name]
        bwd = [2 * lay.flops * b / flops for lay in layers_]
        fwd = sum(lay.flops for lay in layers_) * b / flops
        nbytes = [lay.numel * 4 for lay in layers_]
        for algo, fn in ALGORITHMS.items():
            ys = []
            for n in WORLDS:
                it = ddp_iteration(
                    fwd,
                    bwd,
                    nbytes,
                    25 << 20,
                    lambda x, n=n, fn=fn: fn(x, n, target.alpha, target.beta),
                )
                ys.append(it.iteration)
                ext.append(
                    (
                        name,
                        algo,
                        n,
                        round(it.iteration * 1e3, 3),
                        round(it.exposed * 1e3, 3),
                        round(100 * it.compute / it.iteration, 2),
                    )
                )
            if algo == "ring" or name == "bert-large":
                series.append(
                    Series(
                        f"{name} {algo}",
                        tuple(float(n) for n in WORLDS),
                        tuple(y / ys[0] for y in ys),
                        "line" if algo == "ring" else "dashed",
                    )
                )
    verdicts = tuple(
        within(
            f"cost model predicts the measured DDP iteration ({r[0]} MLP, 2 ranks)",
            "xgrad's alpha-beta model, compute measured here",
            r[1],
            r[2],
            rel_tol=0.15,
            fmt=".2f",
            why="ms;",
            why_not="bucket launch and copy CPU time, and the machine's load, are not in the model",
        )
        for r in rows
    )
    return Report(
        name="scaling",
        title="cost model: validated at 2 ranks, extrapolated to 1024 (ResNet-50, BERT-large, GPT-2)",
        link=link_description("sim", link)
        + f"; extrapolation: alpha {args.target_alpha * 1e6:g} us, "
        f"{args.target_gbps:g} GB/s",
        backend=args.backend,
        config={
            "sizes": [list(s) for s in sizes],
            "flops": args.flops,
            "target_alpha": args.target_alpha,
            "target_gbps": args.target_gbps,
            "batch": BATCH,
        },
        tables=(
            Table("validation", ("model", "predicted_ms", "measured_ms", "error_pct"), tuple(rows)),
            Table(
                "extrapolation",
                ("model", "allreduce", "ranks", "iteration_ms", "exposed_ms", "compute_pct"),
                tuple(ext),
            ),
        ),
        panels=(
            Panel(
                "validation: predicted vs measured",
                "run",
                "ms",
                (
                    Series(
                        "predicted",
                        tuple(float(i) for i in range(len(rows))),
                        tuple(r[1] for r in rows),
                        "bar",
                    ),
                    Series(
                        "measured",
                        tuple(float(i) for i in range(len(rows))),
                        tuple(r[2] for r in rows),
                        "bar",
                    ),
                ),
                xticklabels=tuple(r[0] for r in rows),
            ),
            Panel(
                "iteration time relative to 2 ranks",
                "ranks",
                "T(N) / T(2)",
                tuple(series),
                logx=True,
            ),
        ),
        verdicts=verdicts,
        notes=(
            f"compute rate used: {flops / 1e9:.2f} Gflop/s per rank "
            f"({'given' if args.flops else 'measured here'})",
        ),
    )
