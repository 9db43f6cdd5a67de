"""``xgrad bench TARGET``: benchmarks that compare xgrad with PyTorch's own implementation.

Each target is a module with ``HELP``, ``add_arguments`` and ``run``, imported only when
it runs (the torch and jax ones need those frameworks).
"""

from __future__ import annotations

import argparse

from xgrad.cli import run_module

HELP = "benchmarks against PyTorch's own implementations, reported as ratios"

#: target -> module implementing it.
TARGETS: dict[str, str] = {
    "ddp": "xgrad.torch_backend.bench",
    "jax": "xgrad.jax_backend.bench",
    "pipeline": "xgrad.torch_backend.pipeline_bench",
    "graph": "xgrad.graph_bench",
    "faults": "xgrad.torch_backend.faults_bench",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=sorted(TARGETS), help="what to benchmark")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="the target's own options")


def run(args: argparse.Namespace) -> int:
    return run_module(TARGETS[args.target], f"xgrad bench {args.target}", args.rest)
