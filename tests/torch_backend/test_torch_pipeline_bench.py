"""``xgrad bench pipeline`` runs end to end at tiny sizes (its speed is not tested)."""

from __future__ import annotations

import csv
import importlib
import json
import math
import pathlib

import pytest

import xgrad.pipeline as xp
from xgrad.cli import main

pytest.importorskip("torch")


def test_bench_prints_ratios_bubbles_and_memory(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = ("gpipe", "1f1b", "interleaved_zb", "dualpipev")
    argv = ["bench", "pipeline", "-p", "2", "-m", "4", "--batch", "8", "--width", "4"]
    argv += ["--schedules", ",".join(names), "--layers", "2", "--warmup", "0"]
    argv += ["--steps", "2", "--launches", "2"]  # one timed step in each launch
    files = ["--json", str(tmp_path / "p.json"), "--csv", str(tmp_path / "p.csv")]
    assert main([*argv, "--timeout", "200", *files]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "median of 2 timed steps over 2 launch(es) of fresh processes" in lines[0]
    head = lines.index(next(line for line in lines if line.startswith("schedule ")))
    for name in names:
        rows = [line for line in lines[head:] if line.split()[:1] == [name]]
        assert len(rows) == 2, rows  # the speed row and the simulator row
        verdict, launches = rows[0].split(maxsplit=7)[6:]
        assert verdict == "too-few" and launches.count("[") == 2  # one step a launch
        measured, simulated, error = rows[1].split()[1:4]
        assert float(error.rstrip("%")) / 100 == pytest.approx(
            float(simulated) / float(measured) - 1, abs=2e-3
        )
        equal = float(rows[1].split()[6])
        # The per-message latency fed to the simulator: a mean of send-end-to-wake-up
        # samples, which may be at or below zero when a waking receiver preempts its sender.
        assert math.isfinite(float(rows[1].split()[7]))
        assert equal == pytest.approx(xp.simulate(xp.make(name, 2, 4)).bubble_fraction, abs=1e-3)
    assert "us from a ping-pong" in out
    assert "peak memory per stage, MiB (heap: C heap in use above the step's start (" in out
    for stage in (0, 1):
        line = next(line for line in lines if line.startswith(f"stage {stage}: "))
        cells = dict(zip(names, line.split(": ", 1)[1].split(" | "), strict=True))
        for name, cell in cells.items():
            assert cell.startswith(f"{name} ")
            figures = dict(item.split("=") for item in cell[len(name) + 1 :].split(", "))
            assert list(figures) == ["torch_heap", "xgrad_heap", "xgrad_activation"]
            for figure in figures.values():
                assert figure.endswith(" MiB") and float(figure.removesuffix(" MiB")) >= 0
    # The three sections as data: one speed and one simulator row per schedule, and one
    # memory row per stage, schedule and figure; the CSV says which table a row is from.
    data = json.loads((tmp_path / "p.json").read_text())
    assert list(data) == ["bench pipeline", "simulator", "peak memory"]
    assert [r["schedule"] for r in data["bench pipeline"]] == list(names)
    for r, name in zip(data["bench pipeline"], names, strict=True):
        # One step per launch: each launch's interval is its one ratio; the pooled median
        # of two is their mean, its interval their range (too few steps for 95%).
        lows, mids, highs = (
            [float(v) for v in r[k].split("/")]
            for k in ("launch_lows", "launch_ratios", "launch_highs")
        )
        assert lows == mids == highs and len(mids) == 2
        assert r["ratio"] == pytest.approx(sum(mids) / 2)
        assert (r["ratio_low"], r["ratio_high"]) == (min(mids), max(mids))
        assert r["verdict"] == "too-few"  # two launches of one step: not judged
        row = next(line for line in lines[head:] if line.split()[:1] == [name])
        assert float(row.split()[3]) == pytest.approx(r["ratio"], abs=1e-3)
    for r in data["simulator"]:
        assert r["error"] == pytest.approx(r["simulated_s"] / r["measured_s"] - 1)
    assert len(data["peak memory"]) == 2 * len(names) * 3
    assert all(r["bytes"] >= 0 for r in data["peak memory"])
    tables = [row["table"] for row in csv.DictReader((tmp_path / "p.csv").open())]
    assert tables.count("bench pipeline") == len(names) and tables.count("simulator") == len(names)


def test_an_uneven_batch_is_refused_saying_torch_cannot_run_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch's stages size each receive from microbatch 0: every schedule of theirs failed
    on --batch 10, m = 4 (3, 3, 2, 2 rows), at p = 2. Refused, saying so, before any
    process starts (a launch here fails the test)."""

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started")

    # The package's own ``spawn`` (the function) hides the module of that name.
    monkeypatch.setattr(importlib.import_module("xgrad.torch_backend.spawn"), "spawn", no_launch)
    monkeypatch.setattr("sys.argv", ["xgrad", "bench", "pipeline", "-m", "4", "--batch", "10"])
    monkeypatch.delenv("XGRAD_TRACEBACK", raising=False)
    assert main() == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "xgrad bench pipeline: error: --batch 10 is not a multiple of --microbatches 4 "
        "(2 microbatches of 3 rows, 2 of 2): torch.distributed.pipelining cannot run uneven "
        "microbatches across ranks"
    )
    assert "give a multiple of 4, such as 8 or 12" in err and len(err.splitlines()) == 1
    with pytest.raises(ValueError, match="--batch 3 is smaller than --microbatches 4"):
        main(["bench", "pipeline", "-m", "4", "--batch", "3"])


def test_bench_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="--batch 5 is not a multiple of --microbatches 2"):
        main(["bench", "pipeline", "-m", "2", "--batch", "5"])
    with pytest.raises(ValueError, match="--stages must be >= 2"):
        main(["bench", "pipeline", "-p", "1"])
    with pytest.raises(ValueError, match="--width must be > 0, got 0"):
        main(["bench", "pipeline", "--width", "0"])
    with pytest.raises(ValueError, match="--launches must be >= 1, got 0"):
        main(["bench", "pipeline", "--launches", "0"])
    with pytest.raises(ValueError, match="--launches 3 needs at least as many steps to split"):
        main(["bench", "pipeline", "--launches", "3", "--steps", "2"])
    with pytest.raises(ValueError, match="--warmup must be >= 0, got -1"):
        main(["bench", "pipeline", "--warmup", "-1"])
    with pytest.raises(SystemExit):  # argparse's one-line error, before any process starts
        main(["bench", "pipeline", "--json", "no/such/folder/p.json"])
    with pytest.raises(ValueError, match="choose from gpipe"):
        main(["bench", "pipeline", "--schedules", "zb_h1"])
    with pytest.raises(ValueError, match="dualpipev needs num_microbatches >= the 8 stages"):
        main(["bench", "pipeline", "-p", "4", "-m", "4", "--schedules", "dualpipev"])
