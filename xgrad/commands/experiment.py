"""``xgrad experiment NAME``: run a paper experiment (seeded; prints a table, writes CSV/JSON)."""

from __future__ import annotations

import argparse

from xgrad.cli import run_module
from xgrad.experiments import EXPERIMENTS

HELP = "paper experiments on the reference backend's virtual clock (tables, CSV, JSON)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(EXPERIMENTS), help="which experiment")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="the experiment's own options")


def run(args: argparse.Namespace) -> int:
    return run_module(EXPERIMENTS[args.name], f"xgrad experiment {args.name}", args.rest)
