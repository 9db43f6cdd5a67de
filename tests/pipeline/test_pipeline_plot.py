"""The timeline PNG says which chunk each box is, has a legend, and the bubble in its title."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import xgrad.pipeline as xp

matplotlib = pytest.importorskip("matplotlib")


def _drawn(monkeypatch: pytest.MonkeyPatch, schedule: xp.Schedule, tmp_path: Path) -> Any:
    from matplotlib.figure import Figure

    from xgrad.pipeline.plot import save_timeline_png

    seen: list[Any] = []
    real = Figure.savefig

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(self)
        real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    sim = xp.simulate(schedule)
    save_timeline_png(sim, tmp_path / "t.png", name=schedule.name)
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    return seen[0].axes[0], sim


def test_interleaved_boxes_name_their_chunk(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ax, sim = _drawn(monkeypatch, xp.interleaved_1f1b(2, 4), tmp_path)
    labels = [t.get_text() for t in ax.texts]
    # Rank 0 runs stages 0 and 2: "0F0" and "2F0" are different boxes (not "F0" twice).
    assert "0F0" in labels and "2F0" in labels and labels.count("0F0") == 1
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "F forward" in legend and "chunk 1 of a rank" in legend
    assert f"bubble fraction {sim.bubble_fraction:.3f}" in ax.get_title()
    assert "interleaved_1f1b" in ax.get_title()


def test_zero_bubble_legend_has_i_and_w(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ax, _ = _drawn(monkeypatch, xp.zb_h1(2, 3), tmp_path)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "I backward, input gradient" in legend and "W backward, weight gradient" in legend
    assert not any(t.startswith("chunk") for t in legend)  # one stage per rank
