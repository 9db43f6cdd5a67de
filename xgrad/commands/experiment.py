"""``xgrad experiment NAME``: run a paper experiment (seeded; prints a table, writes CSV/JSON)."""

from __future__ import annotations

import argparse
import importlib

from xgrad.experiments import EXPERIMENTS

HELP = "paper experiments on the reference backend's virtual clock (tables, CSV, JSON)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(EXPERIMENTS), help="which experiment")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="the experiment's own options")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(EXPERIMENTS[args.name])
    sub = argparse.ArgumentParser(prog=f"xgrad experiment {args.name}", description=module.HELP)
    module.add_arguments(sub)
    return int(module.run(sub.parse_args(args.rest)) or 0)
