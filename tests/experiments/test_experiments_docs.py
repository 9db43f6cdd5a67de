"""docs/experiments.md: rendered from the runs' files, figures made by the current code.

The page must be exactly what ``xgrad experiment docs`` renders from the JSON next to
each figure; every experiment has its figure and the command that made it; and the
schedules experiment (deterministic, fast) is rerun with the documented command, which
must reproduce its tables' digest and its PNG byte for byte. The other experiments'
signatures are compared with fresh ``--quick`` runs in their own tests.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from xgrad.cli import main
from xgrad.experiments.docs import DOC_EXPERIMENTS, render
from xgrad.experiments.report import signature
from xgrad.experiments.runner import run_experiment

DOCS = Path(__file__).resolve().parents[2] / "docs"


def documented(name: str) -> dict:
    return json.loads((DOCS / "experiments" / f"{name}.json").read_text())


def test_the_page_is_rendered_from_the_results() -> None:
    assert (DOCS / "experiments.md").read_text() == render(DOCS / "experiments")


def test_every_experiment_has_its_figure_and_command() -> None:
    page = (DOCS / "experiments.md").read_text()
    for name in DOC_EXPERIMENTS:
        doc = documented(name)
        assert doc["name"] == name
        words = shlex.split(doc["command"])
        assert words[:4] == ["xgrad", "experiment", "run", name], doc["command"]
        assert "--quick" not in words, f"{name}: the page must show full runs"
        assert (DOCS / "experiments" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
        assert f"![{name}](experiments/{name}.png)" in page


def test_schedules_figure_and_tables_come_from_the_current_code(tmp_path: Path) -> None:
    doc = documented("schedules")
    words = shlex.split(doc["command"])[1:]
    out = words.index("--out")
    words[out + 1] = str(tmp_path)
    assert main(words) == 0
    fresh = json.loads((tmp_path / "schedules.json").read_text())
    assert fresh["signature"] == doc["signature"] == signature(doc)
    assert fresh["deterministic_digest"] == doc["deterministic_digest"]
    png = (DOCS / "experiments" / "schedules.png").read_bytes()
    assert (tmp_path / "schedules.png").read_bytes() == png


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["allreduce-size", "overlap", "pipeline-bubble", "compression", "cross-framework", "scaling"],
)
def test_quick_runs_report_what_the_page_shows(name: str, tmp_path: Path) -> None:
    """The experiments not run elsewhere in the tests: a quick run works and has the shape
    (tables, columns, axes, sources) of the documented full run."""
    code, report = run_experiment(name, ["--quick", "--out", str(tmp_path)])
    assert code == 0 and report is not None
    assert report.signature() == signature(documented(name))
    assert (tmp_path / f"{name}.png").exists() and (tmp_path / f"{name}.csv").exists()
