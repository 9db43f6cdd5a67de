"""``xgrad experiment list | run NAME [--quick] [--backend B] [--out DIR] | docs``.

With no words it lists the experiments. ``run NAME --help`` shows an experiment's own
options. ``docs`` reruns every experiment into ``docs/experiments/`` and writes
``docs/experiments.md`` from what they wrote. The older form ``xgrad experiment NAME ...``
still runs ``NAME``.
"""

from __future__ import annotations

import argparse
import sys

from xgrad.experiments import EXPERIMENTS, SUMMARIES

HELP = "paper experiments: tables, JSON, CSV and a plot each, the paper's prediction and a verdict"

_USAGE = "xgrad experiment [list | run NAME [--quick] [--backend B] [--out DIR] ... | docs ...]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = _USAGE
    parser.add_argument("words", nargs=argparse.REMAINDER, help="list | run NAME ... | docs ...")


def list_experiments() -> str:
    width = max(len(n) for n in EXPERIMENTS)
    lines = ["experiments (xgrad experiment run NAME [--quick] [--backend B] [--out DIR]):"]
    lines += [f"  {name:<{width}}  {SUMMARIES[name]}" for name in EXPERIMENTS]
    return "\n".join(lines)


def _usage_error(message: str) -> int:
    """Exit status 2 with the usage, as argparse ends a command line it cannot take.

    A script tells a mistyped command line (2) from an experiment that ran and failed (1).
    """
    print(f"usage: {_USAGE}\n\n{list_experiments()}\n", file=sys.stderr)
    print(f"xgrad experiment: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    words = list(args.words)
    if not words or words[0] == "list":
        print(list_experiments())
        return 0
    if words[0] == "docs":
        from xgrad.experiments.docs import main as docs_main

        return docs_main(words[1:])
    if words[0] == "run":
        if len(words) < 2 or words[1].startswith("-"):
            return _usage_error("run needs an experiment's NAME")
        name, rest = words[1], words[2:]
    else:
        name, rest = words[0], words[1:]
    if name not in EXPERIMENTS:
        return _usage_error(f"unknown experiment {name!r} (choose from {', '.join(EXPERIMENTS)})")
    from xgrad.experiments.runner import run_experiment

    return run_experiment(name, rest)[0]
