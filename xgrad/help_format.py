"""Command-line help that shows every option, each with its default (all of xgrad's commands)."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter", "with_help_lines"]


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
