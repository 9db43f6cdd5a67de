"""``xgrad backends``: the registered backends and whether each can run here."""

from __future__ import annotations

import argparse

from xgrad.backend import backend_available, list_backends

HELP = "List the registered backends (built in and from the xgrad.backends entry points)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", help="only these backends")


def run(args: argparse.Namespace) -> int:
    names = args.names or list_backends()
    width = max(len(n) for n in names)
    status = 0
    for name in names:
        try:
            ok, why = backend_available(name)
        except KeyError as err:
            print(err.args[0])
            status = 2
            continue
        print(f"{name.ljust(width)}  {'available' if ok else 'unavailable: ' + why}")
    return status
