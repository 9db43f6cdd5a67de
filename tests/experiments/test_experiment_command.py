"""``xgrad experiment``: list, run, the older form, and errors that name the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xgrad.cli import main
from xgrad.experiments import EXPERIMENTS


def test_no_words_and_list_print_every_experiment(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["experiment"], ["experiment", "list"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert all(name in out for name in EXPERIMENTS)


def test_unknown_names_and_backends_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # Exit status 2 with the usage, as argparse ends a command line it cannot take (was 1,
    # the status of an experiment that ran and failed).
    assert main(["experiment", "run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: xgrad experiment")
    assert err.strip().splitlines()[-1] == "xgrad experiment: error: run needs an experiment's NAME"
    for argv in (["experiment", "run", "bubble"], ["experiment", "bubble"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: xgrad experiment")
        last = err.strip().splitlines()[-1]
        assert last.startswith("xgrad experiment: error: unknown experiment 'bubble' (choose")
    with pytest.raises(SystemExit):
        main(["experiment", "run", "schedules", "--backend", "jax"])
    assert "invalid choice: 'jax'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--stages must be >= 1, got 0"):
        main(["experiment", "run", "schedules", "--stages", "0", "--out", "/nonexistent"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["overlap", "--cap-mb", "0"], "--cap-mb must be a finite number of MiB > 0, got 0.0"),
        (["scaling", "--flops", "0"], "--flops must be a finite number > 0, got 0.0"),
        (["scaling", "--target-gbps", "-1"], "--target-gbps must be a finite number > 0, got -1"),
        (["scaling", "--target-alpha", "-1"], "--target-alpha must be a finite number of sec"),
        # Was "comm_cost must be >= 0 and finite", after the validation runs.
        (["scaling", "--target-alpha", "inf"], "--target-alpha must be a finite number of sec"),
        # Named both options in one sentence, the right one and the one that was fine.
        (["compression", "--steps", "0"], r"^--steps=0 must be > 2 \(the first 2 [^-]*$"),
        (["compression", "--batch", "3"], r"^--batch=3 must be even and >= 2 \(split[^-]*$"),
        # A rank's traceback (no gradient to start the backward from; empty microbatches),
        # or a run on empty tensors whose finding was "always/never = nan" (--width 0).
        (["checkpoint", "--layers", "0"], "--layers must be >= 1, got 0"),
        (["checkpoint", "--width", "0"], "--width must be >= 1, got 0"),
        (["checkpoint", "--batch", "0"], "--batch 0 must be a positive multiple of --micro"),
        (["pipeline-bubble", "--layers", "0"], "--layers must be >= 1, got 0"),
        (["pipeline-bubble", "--width", "0"], "--width must be >= 1, got 0"),
        (["pipeline-bubble", "--batch", "0"], "--batch must be >= 1, got 0"),
    ],
)
def test_bad_experiment_options_are_named_before_anything_runs(
    argv: list[str], message: str, tmp_path: Path
) -> None:
    # They ended in a rank's traceback (--cap-mb) or a ZeroDivisionError after the
    # validation runs (scaling).
    with pytest.raises(ValueError, match=message):
        main(["experiment", "run", *argv, "--quick", "--out", str(tmp_path)])


def test_run_prints_the_table_and_verdicts_and_writes_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["experiment", "run", "schedules", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[schedules]" in out and "AGREES" in out and "DISAGREES" in out
    assert "link: none" in out
    assert (tmp_path / "schedules.png").read_bytes()[:4] == b"\x89PNG"
    # Every table as JSON and CSV too.
    assert json.loads((tmp_path / "schedules.json").read_text())["name"] == "schedules"
    assert (tmp_path / "schedules.csv").read_text().count("\n") > 1


def test_out_that_is_a_file_is_one_line_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit):
        main(["experiment", "run", "schedules", "--quick", "--out", str(tmp_path / "f")])
    assert "argument --out: " in capsys.readouterr().err


def test_bucket_sweep_keeps_its_own_options(tmp_path: Path) -> None:
    args = ["--world-sizes", "2", "--caps", "300", "--width", "8", "--layers", "2",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(["experiment", "run", "bucket-sweep", *args]) == 0
    assert main(["experiment", "bucket-sweep", *args]) == 0
    assert (tmp_path / "bucket_sweep.json").exists()


def test_bucket_sweep_refuses_a_negative_seed_naming_it() -> None:
    # NumPy's "expected non-negative integer" came back, naming no option.
    with pytest.raises(ValueError, match="--seed=-1 must be >= 0"):
        main(["experiment", "run", "bucket-sweep", "--seed", "-1"])


def test_a_negative_seed_is_refused_naming_the_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # NumPy's "expected non-negative integer" came back, naming no option.
    with pytest.raises(SystemExit) as exc:
        main(
            ["experiment", "run", "compression", "--quick", "--seed", "-5", "--out", str(tmp_path)]
        )
    assert exc.value.code == 2
    assert "argument --seed: -5 is not >= 0" in capsys.readouterr().err
