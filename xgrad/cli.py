"""The ``xgrad`` command: a thin dispatcher over one module per subcommand.

Each subcommand lives in its own module exposing ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs, so
``xgrad plan`` never pays for importing torch or jax.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from xgrad.help_format import HelpFormatter as HelpFormatter
from xgrad.help_format import settle_quick, with_help_lines

#: subcommand -> module implementing it (imported lazily).
COMMANDS: dict[str, str] = {
    "crosscheck": "xgrad.commands.crosscheck",
    "plan": "xgrad.commands.plan",
    "schedule": "xgrad.commands.schedule",
    "bench": "xgrad.commands.bench",
    "experiment": "xgrad.commands.experiment",
    "backends": "xgrad.commands.backends",
}

#: one-line help per subcommand, kept here so ``xgrad --help`` imports nothing heavy.
SUMMARIES: dict[str, str] = {
    "crosscheck": "run one model on several backends and compare the reduced gradients",
    "plan": "print the bucket plan for a built-in model or a JSON list of sizes",
    "schedule": "print a pipeline schedule's grid and simulated figures",
    "bench": "benchmarks against PyTorch's own implementations (ratios)",
    "experiment": "the papers' experiments, reproduced here: list, run NAME, docs",
    "backends": "list the registered backends and whether they can be imported",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xgrad",
        description="Distributed gradient computation, the same across frameworks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        sub.add_parser(name, help=SUMMARIES[name], add_help=False)
    return parser


def build_module_parser(module: object, prog: str) -> argparse.ArgumentParser:
    """The parser of a command module: its options, each with a help line and default."""
    parser = argparse.ArgumentParser(
        prog=prog, description=getattr(module, "HELP", None), formatter_class=HelpFormatter
    )
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return with_help_lines(parser)


def run_module(path: str, prog: str, argv: Sequence[str]) -> int:
    """Import the command module at ``path``, parse ``argv`` with its options, run it.

    Subcommands, bench targets and experiments are all such modules.
    """
    module = importlib.import_module(path)
    parser = build_module_parser(module, prog)
    return int(module.run(settle_quick(parser.parse_args(list(argv)))) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``xgrad`` command.

    Run as the command (no ``argv``), a ``ValueError`` or ``TypeError`` that escapes a
    subcommand is bad input and printed as one line naming the subcommand, exit status 2
    (``XGRAD_TRACEBACK=1`` shows the traceback); so is an ``OSError`` (an output file that
    cannot be written once the run is done: the message names the path); called from
    Python with ``argv`` it propagates, so callers and tests see the exception itself.
    """
    if argv is not None:
        return _dispatch(list(argv))
    try:
        return _dispatch(sys.argv[1:])
    except BrokenPipeError:
        # The reader went away (`xgrad schedule ... | head`): what it wanted it has, so
        # leave quietly, as a tool killed by SIGPIPE does (128 + 13), and point stdout at
        # nothing so the interpreter's final flush does not raise the same error again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ValueError, TypeError, OSError) as err:
        if os.environ.get("XGRAD_TRACEBACK"):
            raise
        words = [w for w in sys.argv[1:3] if not w.startswith("-")]
        print(f"xgrad {' '.join(words)}: error: {err}".replace("  ", " "), file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        # Let argparse print usage / the unknown-command error with the known names.
        parser.parse_args(argv or ["--help"])
        return 2
    name = argv[0]
    return run_module(COMMANDS[name], f"xgrad {name}", argv[1:])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
