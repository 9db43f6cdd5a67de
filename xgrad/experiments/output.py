"""Printing a report and writing its JSON, CSV and PNG (one implementation for all)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

from xgrad.experiments.report import Panel, Report, Table, Verdict

__all__ = ["format_report", "format_table", "format_verdicts", "plot_png", "write_report"]


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:.4g}"
        return f"{value:.3e}"
    return str(value)


def format_table(table: Table) -> str:
    """A fixed-width text table with its name above it."""
    cells = [[_cell(v) for v in row] for row in table.rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(table.columns)]
    head = "  ".join(c.rjust(w) for c, w in zip(table.columns, widths, strict=True))
    lines = [f"[{table.name}]", head, "-" * len(head)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def format_verdicts(verdicts: tuple[Verdict, ...]) -> str:
    """Each prediction next to the measurement, with the verdict and the reason."""
    lines = []
    for v in verdicts:
        lines.append(f"- {v.claim} ({v.source})")
        lines.append(f"    predicted: {v.predicted}   measured: {v.measured}   -> {v.word.upper()}")
        if v.by:
            lines[-1] += f", by {v.by}"
        if v.why:
            lines.append(f"    why: {v.why}")
    return "\n".join(lines)


def format_report(report: Report) -> str:
    """The whole report as text: title, link, tables, verdicts, notes."""
    parts = [
        f"{report.name}: {report.title}",
        f"backend: {report.backend}; link: {report.link}",
        *(format_table(t) for t in report.tables),
        "paper vs measured:",
        format_verdicts(report.verdicts),
    ]
    parts += [f"note: {n}" for n in report.notes]
    return "\n\n".join(parts)


def _draw(ax: Any, panel: Panel) -> None:
    bars = [s for s in panel.series if s.kind == "bar"]
    width = 0.8 / max(1, len(bars))
    for s in panel.series:
        if s.kind == "bar":
            k = bars.index(s)
            xs = [x - 0.4 + width * (k + 0.5) for x in s.x]
            ax.bar(xs, s.y, width=width, label=s.label)
        else:
            ax.plot(s.x, s.y, "--" if s.kind == "dashed" else "-o", label=s.label, markersize=3)
    if panel.xticklabels:
        ax.set_xticks(range(len(panel.xticklabels)))
        ax.set_xticklabels(panel.xticklabels, rotation=20, fontsize=7)
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    if panel.logx:
        ax.set_xscale("log", base=2)
    if panel.logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if panel.series:
        ax.legend(fontsize=7)


def plot_png(report: Report, path: Path) -> None:
    """Draw the report's panels side by side into ``path`` (matplotlib, no display)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("plots need matplotlib: pip install 'xgrad[plot]'") from err
    n = max(1, len(report.panels))
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 3.6), squeeze=False)
    for ax, panel in zip(axes[0], report.panels, strict=False):
        _draw(ax, panel)
    fig.suptitle(f"{report.name}: {report.title}", fontsize=10)
    fig.tight_layout()
    # A fixed date keeps the PNG's bytes a function of the figure alone.
    fig.savefig(path, dpi=90, metadata={"Software": None, "CreationDate": None})
    plt.close(fig)


def write_report(report: Report, out: Path, command: str) -> dict[str, Path]:
    """Write ``NAME.json`` (everything, plus the command that made it), ``NAME.csv`` (the
    main table; ``NAME.TABLE.csv`` for the others) and ``NAME.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    doc = report.to_dict()
    doc["command"] = command
    json_path = out / f"{report.name}.json"
    json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    written["json"] = json_path
    for i, table in enumerate(report.tables):
        path = out / (f"{report.name}.csv" if i == 0 else f"{report.name}.{table.name}.csv")
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(table.columns)
            writer.writerows(table.rows)
        written["csv" if i == 0 else f"csv:{table.name}"] = path
    png = out / f"{report.name}.png"
    try:
        plot_png(report, png)
    except ImportError as err:  # the tables and verdicts stand without the figure
        print(f"no plot written: {err}", file=sys.stderr)
    else:
        written["png"] = png
    return written
