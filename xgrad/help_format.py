"""Command-line help that shows every option, each with its default (all of xgrad's commands)."""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

__all__ = ["HelpFormatter", "QuickDefault", "settle_quick", "with_help_lines"]


class QuickDefault(NamedTuple):
    """The default of an option that ``--quick`` makes smaller: ``full``, or ``quick`` under
    ``--quick``. A value the user gives wins either way, so ``--quick --steps 20`` runs 20
    steps (a flag that silently overrode an explicit option made a figure the user did not
    ask for). Resolved by :func:`settle_quick` once the options are parsed.
    """

    full: Any
    quick: Any

    def __str__(self) -> str:  # what ``%(default)s`` shows in the help
        return f"{_shown(self.full)}; with --quick {_shown(self.quick)}"


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def settle_quick(args: argparse.Namespace) -> argparse.Namespace:
    """Replace every :class:`QuickDefault` left in ``args`` (an option not given) with its
    full or quick value, as ``args.quick`` says. Every parser of xgrad's commands calls it
    after parsing, so a command module never sees a :class:`QuickDefault`.
    """
    quick = bool(getattr(args, "quick", False))
    for name, value in vars(args).items():
        if isinstance(value, QuickDefault):
            setattr(args, name, value.quick if quick else value.full)
    return args


class HelpFormatter(argparse.HelpFormatter):
    """Every option gets a help line, and the line shows its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = (
            "default" not in text.lower()
            and default is not argparse.SUPPRESS
            and action.option_strings
            and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
            and not isinstance(action, argparse._HelpAction)
        )
        if shown:
            text = f"{text} (default: {'none' if default is None else '%(default)s'})".strip()
        return text


def with_help_lines(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give every option of ``parser`` a help line (argparse prints none for one without)."""
    for action in parser._actions:
        if not action.help and action.help is not argparse.SUPPRESS:
            action.help = action.dest.replace("_", " ")
    return parser
