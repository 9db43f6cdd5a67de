"""Runs one experiment: common options, backend check, the table, the files, the verdicts."""

from __future__ import annotations

import argparse
import importlib
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from xgrad.backend import backend_available
from xgrad.experiments import EXPERIMENTS, STANDALONE
from xgrad.experiments.link import DEFAULT_ALPHA, DEFAULT_BETA
from xgrad.experiments.output import format_report, write_report
from xgrad.experiments.report import Report
from xgrad.help_format import HelpFormatter, settle_quick, with_help_lines
from xgrad.tables import unmakeable_folder

__all__ = ["DEFAULT_OUT", "build_parser", "load", "run_experiment"]

DEFAULT_OUT = Path("xgrad-out") / "experiments"


def load(name: str) -> ModuleType:
    """The module of experiment ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in EXPERIMENTS:
        raise ValueError(
            f"unknown experiment {name!r}; known experiments: {', '.join(EXPERIMENTS)}"
        )
    return importlib.import_module(EXPERIMENTS[name])


def _positive(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def _seed(text: str) -> int:
    """A seed: the experiments seed NumPy's generators, which take no negative one (a
    negative seed ended as NumPy's "expected non-negative integer", naming no option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not >= 0")
    return value


def _results_folder(text: str) -> Path:
    """argparse type: a folder for the results, made (with its parents) if missing."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    return path


def build_parser(name: str, module: ModuleType) -> argparse.ArgumentParser:
    """The options of ``xgrad experiment run NAME``: the common ones, then the module's."""
    parser = argparse.ArgumentParser(
        prog=f"xgrad experiment run {name}", description=module.HELP, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="a small version (under 30 s; the tests use it)"
    )
    parser.add_argument(
        "--backend",
        choices=module.BACKENDS,
        default=module.BACKENDS[0],
        help=f"backend to run on (default {module.BACKENDS[0]})",
    )
    parser.add_argument(
        "--out",
        type=_results_folder,
        default=DEFAULT_OUT,
        help=f"results folder: NAME.json, NAME.csv, NAME.png (default {DEFAULT_OUT})",
    )
    parser.add_argument("--seed", type=_seed, default=0, help="seeds weights and data")
    parser.add_argument(
        "--link",
        choices=module.LINKS,
        default=module.LINKS[0],
        help="sim: real reduction then an alpha-beta wait; real: loopback gloo timings; "
        "virtual: the reference backend's virtual clock",
    )
    alpha, beta = getattr(module, "LINK_DEFAULTS", (DEFAULT_ALPHA, DEFAULT_BETA))
    parser.add_argument(
        "--alpha",
        type=_positive,
        default=alpha,
        help=f"link latency per message (s, default {alpha:g})",
    )
    parser.add_argument(
        "--beta", type=_positive, default=beta, help=f"link seconds per byte (default {beta:g})"
    )
    extra = getattr(module, "add_arguments", None)
    if extra is not None:
        extra(parser)
    return with_help_lines(parser)


def run_experiment(name: str, argv: Sequence[str]) -> tuple[int, Report | None]:
    """Parse ``argv``, run experiment ``name``, print its report and write its files."""
    module = load(name)
    if name in STANDALONE:
        from xgrad.cli import run_module

        return run_module(EXPERIMENTS[name], f"xgrad experiment run {name}", argv), None
    parser = build_parser(name, module)
    args = settle_quick(parser.parse_args(list(argv)))
    why = unmakeable_folder(args.out)  # before the run, which it would otherwise cost
    if why is not None:
        parser.error(f"argument --out: {why}")
    ok, why = backend_available(args.backend)
    if not ok:
        raise RuntimeError(f"experiment {name}: backend {args.backend!r} cannot run here: {why}")
    start = time.perf_counter()
    report: Report = module.run(args)
    elapsed = time.perf_counter() - start
    print(format_report(report))
    command = shlex.join(["xgrad", "experiment", "run", name, *argv])
    written = write_report(report, args.out, command)
    print(f"\n{name} took {elapsed:.1f} s; wrote " + ", ".join(str(p) for p in written.values()))
    return 0, report
