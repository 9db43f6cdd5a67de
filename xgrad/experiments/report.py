"""What an experiment returns: tables, a figure and verdicts, as frozen data.

An experiment measures; this module only holds what it found, so that printing, writing
JSON/CSV, drawing the PNG and rendering ``docs/experiments.md`` are done once for all
experiments, and so that a report can be compared with another one (the *signature*: the
shape of the report without its numbers; the *deterministic digest*: the numbers of the
tables that do not depend on timing).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Panel", "Report", "Series", "Table", "Verdict", "signature", "within"]


@dataclass(frozen=True)
class Table:
    """Rows of values under named columns.

    Attributes:
        name: short name (also the CSV file's suffix).
        columns: column headers.
        rows: one tuple per row, as long as ``columns``.
        deterministic: whether the numbers depend only on the seed and settings (virtual
            clocks, simulations, counts), not on how fast this machine was.
    """

    name: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    deterministic: bool = False

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(
                    f"table {self.name!r}: row {row!r} has {len(row)} values for "
                    f"{len(self.columns)} columns {self.columns}"
                )

    def column(self, name: str) -> list[Any]:
        """The values of column ``name``, top to bottom."""
        return [row[self.columns.index(name)] for row in self.rows]


@dataclass(frozen=True)
class Series:
    """One line of a plot: ``kind`` ``"line"``, ``"dashed"`` (a prediction) or ``"bar"``."""

    label: str
    x: tuple[float, ...]
    y: tuple[float, ...]
    kind: str = "line"


@dataclass(frozen=True)
class Panel:
    """One plot of the figure; the panels of a report are drawn side by side."""

    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    logx: bool = False
    logy: bool = False
    #: names for the x positions 0, 1, 2, ... (categorical panels such as bar charts).
    xticklabels: tuple[str, ...] = ()


@dataclass(frozen=True)
class Verdict:
    """The paper's prediction next to what was measured.

    Attributes:
        claim: what the paper says, in words.
        source: where (paper, figure or table).
        predicted: the prediction as a figure or phrase.
        measured: what this run found.
        agrees: whether the measurement bears the claim out.
        by: how far apart they are (e.g. ``"+12% (tolerance 15%)"``).
        why: the reason, especially where they disagree.
    """

    claim: str
    source: str
    predicted: str
    measured: str
    agrees: bool
    by: str = ""
    why: str = ""

    @property
    def word(self) -> str:
        return "agrees" if self.agrees else "disagrees"


def within(
    claim: str,
    source: str,
    predicted: float,
    measured: float,
    *,
    rel_tol: float,
    fmt: str = ".3g",
    why: str = "",
    why_not: str = "",
) -> Verdict:
    """A verdict that agrees when ``measured`` is within ``rel_tol`` of ``predicted``.

    Args:
        why: said either way; why_not: said (after ``why``) when they disagree.
    """
    if predicted == 0:
        diff = abs(measured)
        agrees = diff <= rel_tol
        by = f"{measured - predicted:+{fmt}} (absolute tolerance {rel_tol:g})"
    else:
        rel = (measured - predicted) / abs(predicted)
        agrees = abs(rel) <= rel_tol
        by = f"{100 * rel:+.1f}% (tolerance {100 * rel_tol:g}%)"
    reason = why if agrees or not why_not else f"{why} {why_not}".strip()
    return Verdict(
        claim,
        source,
        f"{predicted:{fmt}}",
        f"{measured:{fmt}}",
        agrees,
        by,
        reason,
    )


@dataclass(frozen=True)
class Report:
    """Everything one run of one experiment found.

    Attributes:
        name: the experiment's name (``xgrad experiment run NAME``).
        title: one line.
        link: which link carried the communication: the real loopback gloo one, the
            simulated alpha-beta one, a virtual clock, or none.
        backend: the backend that ran it.
        config: the settings that determine the numbers (seed included).
        tables: the results; the first is the main one.
        panels: the figure, panel by panel.
        verdicts: the paper's predictions against the measurements.
        notes: anything else a reader must know to trust the numbers.
    """

    name: str
    title: str
    link: str
    backend: str
    config: Mapping[str, Any]
    tables: tuple[Table, ...]
    panels: tuple[Panel, ...]
    verdicts: tuple[Verdict, ...]
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["config"] = dict(self.config)
        for v, d in zip(self.verdicts, doc["verdicts"], strict=True):
            d["verdict"] = v.word
        doc["signature"] = self.signature()
        doc["deterministic_digest"] = self.deterministic_digest()
        return doc

    def signature(self) -> str:
        """See :func:`signature`."""
        return signature(asdict(self))

    def deterministic_digest(self) -> str:
        """A digest of the deterministic tables' rows and of the config: two runs of the
        same code with the same settings give the same digest whatever the machine."""
        rows = [(t.name, [list(r) for r in t.rows]) for t in self.tables if t.deterministic]
        return _digest({"config": dict(self.config), "rows": rows})


def signature(doc: Mapping[str, Any]) -> str:
    """A digest of a report's shape (``Report`` as a dict, or its JSON): its tables and
    their columns, the axes of its panels and the sources of the claims it checks. The
    same for ``--quick`` and a full run of the same code (sizes, counts and the number of
    panels may differ), different when the code changes what it reports."""
    shape = {
        "name": doc["name"],
        "tables": [(t["name"], list(t["columns"])) for t in doc["tables"]],
        "axes": sorted({(p["xlabel"], p["ylabel"]) for p in doc["panels"]}),
        "sources": sorted({v["source"] for v in doc["verdicts"]}),
    }
    return _digest(shape)


def _digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, default=_jsonable)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    return str(value)


def rounded(values: Sequence[float], digits: int = 6) -> tuple[float, ...]:
    """Values rounded for tables (so digests do not see the last bits of float noise)."""
    return tuple(round(float(v), digits) for v in values)
