"""``xgrad bench TARGET``: benchmarks that compare xgrad with PyTorch's own implementation.

Each target is a module with ``HELP``, ``add_arguments`` and ``run``, imported only when
it runs. The core's own targets are listed here; a backend adds its own (its ``BENCHES``),
found through the registry, so no backend is named here.
"""

from __future__ import annotations

import argparse

from xgrad.backend import backend_benches
from xgrad.cli import run_module

HELP = "benchmarks against PyTorch's own implementations, reported as ratios"

#: the core's targets -> module implementing each.
TARGETS: dict[str, str] = {
    "graph": "xgrad.graph_bench",
}


def targets() -> dict[str, str]:
    """The core's targets and every registered backend's."""
    return {**backend_benches(), **TARGETS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=sorted(targets()), help="what to benchmark: %(choices)s")
    parser.add_argument(
        "rest", nargs=argparse.REMAINDER, help="the target's own options (TARGET --help)"
    )


def run(args: argparse.Namespace) -> int:
    return run_module(targets()[args.target], f"xgrad bench {args.target}", args.rest)
