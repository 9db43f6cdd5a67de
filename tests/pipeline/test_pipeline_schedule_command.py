"""``xgrad schedule``: grid and figures printed, CSV and PNG saved, errors clear."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import xgrad.pipeline as xp
from xgrad.cli import main

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_prints_grid_and_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "1f1b", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "step 00: 0F0     1F0     2F0     3F0" in out
    assert "bubble fraction (of total time): 0.2727" in out
    assert "peak activations held per rank, one per (stage, microbatch): 4, 3, 2, 1" in out


def test_timeline_comms_costs_and_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.csv"
    argv = ["schedule", "interleaved_1f1b", "-p", "2", "-m", "4", "-v", "2", "--comms"]
    assert main([*argv, "--timeline", "--costs", "F=1,B=3", "--csv", str(path)]) == 0
    out = capsys.readouterr().out
    assert "SEND_F" in out and "t 00:" in out
    back = xp.load_csv(path)
    assert xp.strip_comms(back).actions == xp.interleaved_1f1b(2, 4, 2).actions
    # torch's lowering, as its _dump_csv writes it: REDUCE_GRAD is where torch's runtime
    # scales the gradients by 1/m, so a file without it would give m times the gradients.
    assert back.actions == xp.insert_comms(xp.add_stage_ops(xp.interleaved_1f1b(2, 4, 2))).actions


def test_bad_sizes_are_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "interleaved_1f1b", "-p", "2", "-m", "5"]) == 2
    assert "multiple of its 2 rounds" in capsys.readouterr().err
    assert main(["schedule", "gpipe", "-p", "2", "-m", "2", "--costs", "X=1"]) == 2
    assert "'X'" in capsys.readouterr().err


def test_costs_with_b_not_i_plus_w_refused_where_both_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # DualPipeV runs full backwards (its overlapped pairs) and split ones (its drain): the
    # simulator times each by its kind, so B=3 with I = W = 1 gave a wrong step time.
    argv = ["schedule", "dualpipev", "-p", "2", "-m", "4", "--costs"]
    assert main([*argv, "B=3"]) == 2
    err = capsys.readouterr().err
    assert "--costs B=3 but I + W = 1 + 1 = 2: dualpipev runs both" in err
    assert main([*argv, "F=1,B=3,I=2,W=1"]) == 0
    assert "step time" in capsys.readouterr().out
    # A schedule with one of the two alone never reads the other costs: accepted.
    assert main(["schedule", "1f1b", "-p", "2", "-m", "4", "--costs", "B=3"]) == 0
    assert main(["schedule", "zb_h1", "-p", "2", "-m", "4", "--costs", "I=2"]) == 0


def test_png_without_matplotlib_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes the import fail, as if matplotlib were absent.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert main(["schedule", "gpipe", "-p", "2", "-m", "2", "--png", str(tmp_path / "t.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib (the plot extra) is not installed")
def test_png_written(tmp_path: Path) -> None:
    path = tmp_path / "t.png"
    assert main(["schedule", "zb_h2", "-p", "3", "-m", "6", "--png", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chunks_help_names_every_schedule_that_takes_chunks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It said "(interleaved_1f1b)" alone; interleaved_zb, looped_bfs, zbv and dualpipev
    take chunks too, and the single-stage schedules none."""
    from xgrad.pipeline.multistage import MULTISTAGE

    with pytest.raises(SystemExit):
        main(["schedule", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    chunks = out[out.index("--chunks") :]
    for name in MULTISTAGE:
        assert name in chunks, (name, chunks)
    assert "zbv and dualpipev take 2 only" in chunks
    assert "the others place one stage per rank" in chunks
