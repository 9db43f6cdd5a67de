"""``xgrad bench ddp`` runs end to end at a tiny size (its speed is not tested here)."""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
import re
import subprocess
import sys

import pytest

from xgrad.cli import main
from xgrad.torch_backend.ddp_bench_rows import CaseResult, CaseSample, pooled, rows_table, table

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_prints_one_row_per_case(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.json"
    args = ["bench", "ddp", "--scale", "tiny", "--models", "mlp,many"]
    args += ["--wide-world-size", "0", "--json", str(out), "--csv", str(tmp_path / "rows.csv")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    # --scale tiny takes 2 rounds of 3 steps per side, and says so.
    assert "median of 6 timed steps per side" in printed
    assert "xgrad DDP vs torch DDP: gloo on CPU, 1 thread(s) per rank, median of 6" in printed
    assert printed.count("| mlp |") == 2 and printed.count("| many |") == 2
    rows = json.loads(out.read_text())["bench ddp"]
    # The CSV has the same rows, one per case, with the ratios.
    csv_rows = list(csv.DictReader((tmp_path / "rows.csv").open()))
    assert [r["model"] for r in csv_rows] == ["mlp", "mlp", "many", "many"]
    assert all(float(r["time_ratio"]) > 0 for r in csv_rows)
    assert [(r["model"], r["find_unused"]) for r in rows] == [
        ("mlp", False),
        ("mlp", True),
        ("many", False),
        ("many", True),
    ]
    assert all(r["xgrad_step"] > 0 and r["torch_step"] > 0 and r["local_step"] > 0 for r in rows)
    assert all(r["steps"] == 6 and r["world"] == 2 for r in rows)
    # CPU per step of the whole process, each side, and their ratio in the CSV.
    assert all(r["xgrad_cpu"] > 0 and r["torch_cpu"] > 0 for r in rows)
    assert all(float(r["cpu_ratio"]) > 0 for r in csv_rows)
    # The time ratio is the median of the paired per-turn ratios, inside its interval.
    assert all(0 < r["ratio_low"] <= r["paired_ratio"] <= r["ratio_high"] for r in rows)
    assert all(r["verdict"] in ("met", "noise", "missed") for r in csv_rows)
    # Memory is what DDP holds: never negative, whatever the heap did meanwhile.
    assert all(r["xgrad_memory"] >= 0 and r["torch_memory"] >= 0 for r in rows)
    assert rows[2]["tensors"] > 200  # the many-small-tensors model


def test_bench_join_runs_each_row_inside_both_sides_join_too(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.json"
    args = ["bench", "ddp", "--scale", "tiny", "--models", "mlp", "--find-unused", "no"]
    args += ["--join", "both", "--wide-world-size", "0", "--json", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert printed.count("| mlp | 2 | no |") == 1 and printed.count("| mlp, join | 2 | no |") == 1
    rows = json.loads(out.read_text())["bench ddp"]
    assert [(r["model"], r["join"]) for r in rows] == [("mlp", False), ("mlp", True)]
    assert all(r["steps"] == 6 and r["paired_ratio"] > 0 for r in rows)


def test_table_shows_ratios() -> None:
    row = CaseResult("mlp", True, 6, 100, 0.0021, 0.002, 3 * 2**20, 2 * 2**20, 5e-6, 4, 48, 0.0015)
    text = table([row])
    assert (
        "| mlp | 4 | yes | 6 | 2.10 | 2.00 | 1.050 | - | missed | - | 3.00 | 2.00 | 1.500 | 5.0 | 100.0 "
        "| 83.3 |" in text
    )


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [(0.97, 0.999, "met"), (0.98, 1.02, "noise"), (1.001, 1.1, "missed")],
)
def test_table_shows_the_paired_ratio_its_interval_and_the_verdict(
    low: float, high: float, verdict: str
) -> None:
    # The ratio of the medians would read 1.050: the paired median is what the row shows.
    row = CaseResult(
        "mlp", False, 6, 100, 0.0021, 0.002, 1, 1, 5e-6, 2, 120, 0.0015, 0.99, low, high
    )
    assert row.time_ratio == 0.99 and row.verdict == verdict
    assert f"| 2.10 | 2.00 | 0.990 [{low:.3f}, {high:.3f}] | - | {verdict} |" in table([row])


def test_table_shows_the_cpu_ratio() -> None:
    row = CaseResult("mlp", False, 6, 100, 0.002, 0.002, 1, 1, 5e-6, 2, 6, 0.001)
    row.xgrad_cpu, row.torch_cpu = 0.003, 0.002
    assert row.cpu_ratio == pytest.approx(1.5)
    assert "| 1.000 | - | met | 1.500 | 0.00 |" in table([row])


def test_table_shows_no_memory_ratio_without_torch_memory() -> None:
    row = CaseResult("many", False, 6, 100, 0.002, 0.002, 0, 0, 5e-6, 2, 6, 0.001)
    assert "| 0.00 | 0.00 | - |" in table([row])


def test_bench_pools_its_launches_and_shows_each(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.json"
    args = ["bench", "ddp", "--scale", "tiny", "--models", "mlp", "--find-unused", "no"]
    args += ["--wide-world-size", "0", "--launches", "2", "--json", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    # The 2 rounds of 3 steps are split between the launches: 6 steps in all, as before.
    assert "median of 6 timed steps per side over 2 launch(es)" in printed
    (row,) = json.loads(out.read_text())["bench ddp"]
    assert row["steps"] == 6
    lows, mids, highs = (
        [float(v) for v in row[k].split("/")]
        for k in ("launch_lows", "launch_ratios", "launch_highs")
    )
    assert len(mids) == 2 and all(
        0 < a <= b <= c for a, b, c in zip(lows, mids, highs, strict=True)
    )
    # 3 turns per launch, 6 pooled, are too few for 95%: every interval is its whole
    # range, so the pooled one spans the launches' together.
    assert row["ratio_low"] == min(lows) and row["ratio_high"] == max(highs)
    shown = re.search(r"\| mlp \| 2 \| no \|(?:[^|]*\|){4} ([0-9.]+)/([0-9.]+) \|", printed)
    assert shown is not None, printed
    assert [float(v) for v in shown.groups()] == pytest.approx(mids, abs=1e-3)


def _sample(xgrad_times: list[float], memory: int = 1, hook: float = 1e-6) -> CaseSample:
    """One launch of mlp at world size 2 whose torch steps all took 1 s (ratios = times)."""
    n = len(xgrad_times)
    ones = (1.0,) * n
    return CaseSample(
        "mlp", False, 2, 8, 100, tuple(xgrad_times), ones, ones, ones, ones, memory, 1, hook
    )


def test_pooled_row_pools_the_turns_but_judges_each_launch() -> None:
    steady = _sample([0.9] * 10, memory=5, hook=1e-6)
    spread = _sample(
        [0.95, 0.96, 0.97, 0.98, 0.99, 1.0, 1.01, 1.02, 1.03, 1.04], memory=7, hook=3e-6
    )
    row = pooled([steady, spread])
    # The 20 turns together: the 6th and 15th smallest bound the median, 0.99 <= 1.00.
    assert (row.ratio_low, row.paired_ratio, row.ratio_high) == (0.9, (0.9 + 0.95) / 2, 0.99)
    # ...but the second launch alone has 1.00 inside [x_2, x_9] of its 10 turns.
    assert row.launches == ((0.9, 0.9, 0.9), (0.96, (0.99 + 1.0) / 2, 1.03))
    assert row.verdict == "noise"
    assert pooled([steady]).verdict == "met" and pooled([spread]).verdict == "noise"
    assert row.steps == 20 and row.torch_step == 1.0
    # Memory: the most any launch held; the hook time: the median over launches.
    assert row.xgrad_memory == 7 and row.hook_seconds == 2e-6
    assert "| 0.925 [0.900, 0.990] | 0.900/0.995 | noise |" in table([row])
    (csv_row,) = rows_table([row]).records()
    assert csv_row["launch_ratios"] == f"0.9/{(0.99 + 1.0) / 2!r}"
    assert csv_row["launch_highs"] == "0.9/1.03" and csv_row["verdict"] == "noise"


def test_six_launches_are_judged_by_their_medians() -> None:
    # Each launch has 1.00 inside its own interval, but all six medians are below it.
    spread = [0.95, 0.96, 0.97, 0.98, 0.99, 1.0, 1.01, 1.02, 1.03, 1.04]
    launches = [_sample([t - shift for t in spread]) for shift in (0.0, 0.01, 0.0, 0.02, 0.0, 0.01)]
    assert all(pooled([one]).verdict == "noise" for one in launches)
    assert pooled(launches).verdict == "met"
    # One launch whose median is above 1.00 leaves the six undecided.
    assert pooled([*launches[:5], _sample([t + 0.02 for t in spread])]).verdict == "noise"


def test_pooled_refuses_launches_of_different_cases() -> None:
    other = CaseSample("many", False, 2, 8, 100, (1.0,), (1.0,), (1.0,), (1.0,), (1.0,), 1, 1, 0.0)
    with pytest.raises(ValueError, match=r"different cases \[\('many', False, 2\), \('mlp'"):
        pooled([_sample([1.0]), other])
    with pytest.raises(ValueError, match="no launch samples"):
        pooled([])
    joined = dataclasses.replace(_sample([1.0]), join=True)
    with pytest.raises(ValueError, match=r"\('mlp', False, 2\) with and without join\(\)"):
        pooled([_sample([1.0]), joined])


def test_unknown_model_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown model\(s\) \['resnet'\]"):
        main(["bench", "ddp", "--models", "resnet"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "0"], "--world-size must be at least 2, got 0"),
        (["--wide-world-size", "1"], "--wide-world-size must be 0 (none) or >= 2, got 1"),
        (["--iters", "0"], "--iters must be at least 1, got 0"),
        (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
        (["--launches", "0"], "--launches must be at least 1, got 0"),
        (
            ["--scale", "tiny", "--launches", "3"],
            "--launches 3 needs at least as many rounds to split, got --rounds 2",
        ),
    ],
)
def test_bad_numbers_are_refused_naming_the_option(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        main(["bench", "ddp", *argv])


def test_output_to_a_missing_folder_is_one_line_naming_the_option(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "ddp", "--csv", str(tmp_path / "missing" / "rows.csv")])
    err = capsys.readouterr().err
    assert "argument --csv" in err and "does not exist" in err and "Traceback" not in err


def test_help_shows_every_option_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "ddp", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--json [FILE]" in text and "--csv [FILE]" in text
    assert "(default: 2)" in text and "(default: 600.0)" in text


@pytest.mark.slow
def test_example_trains_under_torchrun() -> None:
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            str(ROOT / "examples" / "train_ddp.py"),
            "--steps",
            "21",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step  20" in result.stdout
    assert "plan after the rebuild:" in result.stdout
    assert "gradient ready order: 4.bias, 4.weight" in result.stdout
