"""``xgrad backends``: the registered backends, whether each can run here, and their runners."""

from __future__ import annotations

import argparse

from xgrad.backend import backend_available, get_backend, list_backends
from xgrad.commands.options import add_table_outputs
from xgrad.tables import Table, write_tables

HELP = (
    "List the registered backends (built in and from the xgrad.backends entry points), "
    "whether each can run here (and why not), and each one's runners with the hooks and "
    "dtypes they run."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", help="only these backends (default: all)")
    add_table_outputs(parser)


def tables(names: list[str]) -> tuple[Table, Table, list[str]]:
    """The backends table, the runners table, and the names that are not registered."""
    backends, runners, unknown = [], [], []
    for name in names:
        try:
            ok, why = backend_available(name)
        except KeyError as err:
            unknown.append(str(err.args[0]))
            continue
        try:
            module = get_backend(name)
        except Exception:  # unavailable, said above
            backends.append((name, f"unavailable: {why}"))
            continue
        named_only = "" if getattr(module, "BY_DEFAULT", True) else " (runs when named)"
        backends.append((name, ("available" if ok else f"unavailable: {why}") + named_only))
        listed = getattr(module, "runners", None)
        for r in listed() if listed is not None else ():
            hooks = ",".join(r.hooks) or "-"
            runners.append((name, r.name, hooks, ",".join(r.dtypes), r.description))
    return (
        Table(("backend", "status"), tuple(backends), "backends"),
        Table(("backend", "runner", "hooks", "dtypes", "description"), tuple(runners), "runners"),
        unknown,
    )


def run(args: argparse.Namespace) -> int:
    backends, runners, unknown = tables(args.names or list_backends())
    for message in unknown:
        print(message)
    if not write_tables([backends, runners], args.json, args.csv):
        width = max((len(row[0]) for row in backends.rows), default=0)
        for name, status in backends.rows:
            print(f"{name.ljust(width)}  {status}")
        if runners.rows:
            print()
            print(runners.text())
    return 2 if unknown else 0
