"""Tables as data: printed aligned, written as JSON and CSV, by every command that prints one.

A :class:`Table` is a title, column names and rows of plain values. The text form aligns
numbers to the right; JSON keeps the values' types (a list of records per table); CSV has
a ``table`` column when several tables share one file.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xgrad.buckets import NO_LIMIT


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isinf(value):
            return "∞" if value > 0 else "-∞"
        return f"{value:.4g}"
    return str(value)


def near_limit(value: float, limit: float = 1.0, digits: int = 3) -> str:
    """``value`` with ``digits`` decimals, or with more where that many would print the limit.

    Why: a bench judges the figure itself against its target, so 1.0004 printed as
    ``1.000`` next to "missed" reads as a contradiction; one more decimal shows why.
    """
    text = f"{value:.{digits}f}"
    while value != limit and float(text) == limit and digits < 9:
        digits += 1
        text = f"{value:.{digits}f}"
    return text


@dataclass(frozen=True)
class Table:
    """A titled table of plain values (numbers, strings, bools, None)."""

    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    title: str = ""

    def __post_init__(self) -> None:
        for k, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(
                    f"table {self.title!r} row {k} has {len(row)} values for "
                    f"{len(self.columns)} columns {self.columns}"
                )

    def text(self) -> str:
        """Aligned plain text: numbers right, text left; the title above."""
        cells = [list(self.columns)] + [[_cell(v) for v in row] for row in self.rows]
        numeric = [
            all(isinstance(r[c], (int, float)) and not isinstance(r[c], bool) for r in self.rows)
            for c in range(len(self.columns))
        ]
        widths = [max(len(r[c]) for r in cells) for c in range(len(self.columns))]
        lines = [self.title] if self.title else []
        for row in cells:
            parts = [
                v.rjust(w) if right else v.ljust(w)
                for v, w, right in zip(row, widths, numeric, strict=True)
            ]
            lines.append("  " + "  ".join(parts).rstrip())
        return "\n".join(lines)

    def records(self) -> list[dict[str, Any]]:
        """One dict per row, for JSON (infinities as the string ``"inf"``, NaN as null)."""

        def plain(v: Any) -> Any:
            if isinstance(v, float) and math.isnan(v):
                return None
            return "inf" if isinstance(v, float) and math.isinf(v) else v

        return [{c: plain(v) for c, v in zip(self.columns, row, strict=True)} for row in self.rows]


def to_json(tables: Sequence[Table]) -> str:
    """``{title: [records]}`` (one key per table)."""
    return json.dumps(
        {t.title or f"table {k}": t.records() for k, t in enumerate(tables)}, indent=2
    )


def to_csv(tables: Sequence[Table]) -> str:
    """One CSV; with several tables a first ``table`` column says which row is whose."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if len(tables) == 1:
        writer.writerow(tables[0].columns)
        writer.writerows(tables[0].rows)
        return out.getvalue()
    columns: list[str] = []
    for t in tables:
        columns += [c for c in t.columns if c not in columns]
    writer.writerow(["table", *columns])
    for t in tables:
        for record in t.records():
            writer.writerow([t.title, *(record.get(c, "") for c in columns)])
    return out.getvalue()


def unmakeable_folder(path: Path) -> str | None:
    """Why ``path`` cannot be a folder to write results into, or None if it can (checked
    before a long run, without making anything): it is a file, or its nearest existing
    ancestor is a file or not writable."""
    if path.exists():
        if not path.is_dir():
            return f"{str(path)!r} is a file, not a folder"
        return None if os.access(path, os.W_OK) else f"folder {str(path)!r} is not writable"
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot make folder {str(path)!r}: {str(ancestor)!r} is a file"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot make folder {str(path)!r}: {str(ancestor)!r} is not writable"
    return None


def output_file(text: str) -> Path:
    """argparse type: a file to write, whose folder exists (checked before anything runs)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(path.parent)!r} does not exist")
    return path


#: what ``--json``/``--csv`` without a file mean: standard output.
STDOUT = Path("-")


def _output_or_stdout(text: str) -> Path:
    return STDOUT if text == "-" else output_file(text)


def add_table_outputs(parser: argparse.ArgumentParser, what: str = "the table(s)") -> None:
    """``--json [FILE]`` and ``--csv [FILE]``: ``what`` as JSON and CSV (no FILE: stdout).

    Every command and bench that prints a table takes these two, so a missing folder is
    argparse's one-line error naming the option, before a long run rather than after it.
    """
    for fmt in ("json", "csv"):
        parser.add_argument(
            f"--{fmt}",
            type=_output_or_stdout,
            nargs="?",
            const=STDOUT,
            metavar="FILE",
            help=f"write {what} as {fmt.upper()} to FILE (to standard output, instead of "
            "the text, when FILE is left out; default: not written)",
        )


def print_tables(args: argparse.Namespace, tables: Sequence[Table], text: str) -> None:
    """Print ``text`` (the command's own rendering of ``tables``) and write the JSON/CSV
    that ``args.json``/``args.csv`` (from :func:`add_table_outputs`) ask for; the text is
    left out when one of them goes to standard output, so that output stays parseable."""
    if not write_tables(tables, getattr(args, "json", None), getattr(args, "csv", None)):
        print(text)


def write_tables(tables: Sequence[Table], json_path: Path | None, csv_path: Path | None) -> bool:
    """Write ``tables`` as JSON and/or CSV where a path is given (``-``: standard output).

    Returns:
        Whether one of them went to standard output (then the text form is left out).
    """
    to_stdout = False
    for path, text in ((json_path, to_json(tables) + "\n"), (csv_path, to_csv(tables))):
        if path is None:
            continue
        if str(path) == "-":
            print(text, end="")
            to_stdout = True
        else:
            path.write_text(text)
    return to_stdout


def _plan_text(text: str) -> str | None:
    """A plan's JSON as ``[3,2] [1,0] (caps 2048, ∞)``; None if ``text`` is not one."""
    try:
        data = json.loads(text)
        buckets, limits = data["buckets"], data["limits"]
    except (ValueError, TypeError, KeyError):
        return None
    caps = ", ".join("∞" if limit >= NO_LIMIT else str(limit) for limit in limits)
    return " ".join("[" + ",".join(map(str, b)) + "]" for b in buckets) + f" (caps {caps})"


def _brief(value: Any, width: int = 60) -> Any:
    if isinstance(value, str) and value.startswith("{"):
        value = _plan_text(value) or value
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, dict) for v in value):
            return f"{len(value)} records"
        text = ", ".join(str(v) for v in value)
    elif isinstance(value, dict):
        text = ", ".join(f"{k}={v}" for k, v in value.items())
    elif isinstance(value, (bool, int, float)) or value is None:
        return value
    else:
        text = str(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def statistics_table(stats: dict[str, Any], title: str = "statistics") -> Table:
    """A DDP's ``statistics()`` (or any flat record) as a two-column table.

    Lists are shortened, lists of records (a timeline) counted, so the table stays one
    line per statistic; the JSON of the dict itself keeps everything.
    """
    return Table(("statistic", "value"), tuple((k, _brief(v)) for k, v in stats.items()), title)
