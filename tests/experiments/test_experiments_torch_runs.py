"""Quick runs of the torch experiments on real gloo ranks: the properties that do not
depend on timing (gradients, bytes, saved memory), and the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xgrad.experiments.report import signature
from xgrad.experiments.runner import run_experiment

pytest.importorskip("torch")


def documented_signature(name: str) -> str:
    """The signature of the report the docs show for ``name``."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "experiments" / f"{name}.json"
    return signature(json.loads(docs.read_text()))


def test_no_sync_accumulates_the_full_batch_gradient(tmp_path: Path) -> None:
    code, report = run_experiment("no-sync", ["--quick", "--out", str(tmp_path)])
    assert code == 0 and report is not None
    grads, per_sample = report.verdicts[0], report.verdicts[1]
    assert grads.agrees, grads
    assert per_sample.agrees, per_sample  # bytes per sample fall exactly as 1/n
    assert "simulated alpha-beta link" in report.link
    # On the simulated link the prediction's reduction is the link model's, not measured.
    assert report.verdicts[2].source == (
        "alpha-beta cost model with the simulated link's modelled reduction"
    )
    assert (tmp_path / "no-sync.csv").exists() and (tmp_path / "no-sync.png").exists()
    assert report.signature() == documented_signature("no-sync")


def test_checkpointing_saves_less_activation_memory(tmp_path: Path) -> None:
    code, report = run_experiment("checkpoint", ["--quick", "--out", str(tmp_path)])
    assert code == 0 and report is not None
    saved = dict(
        zip(report.tables[0].column("mode"), report.tables[0].column("saved_bytes"), strict=True)
    )
    assert saved["always"] < saved["except_last"] < saved["never"]
    assert report.verdicts[1].agrees
    assert report.signature() == documented_signature("checkpoint")
