"""The ``xgrad`` command's dispatcher and the core subcommands (plan, backends)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from xgrad.buckets import BucketPlan
from xgrad.cli import COMMANDS, main


def test_every_subcommand_module_has_the_interface() -> None:
    import importlib

    for name, path in COMMANDS.items():
        module = importlib.import_module(path)
        assert isinstance(module.HELP, str) and module.HELP, name
        assert callable(module.add_arguments) and callable(module.run), name


def test_unknown_command_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["frobnicate"])
    assert err.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_plan_from_sizes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    code = main(
        ["plan", "--sizes", "[4000000, 2000000, 100]", "--bucket-cap-mb", "4", "--out", str(out)]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "3 parameters, 6000100 bytes, 1 buckets" in text
    # An explicit cap applies to the first bucket too, as in DDP: 100 + 2e6 < 4 MiB, then 0.
    plan = BucketPlan.from_json(out.read_text())
    assert plan.buckets == ((2, 1, 0),)
    first = tmp_path / "first.json"
    argv = ["plan", "--sizes", "[4000000, 2000000, 100]", "--bucket-cap", "4MB"]
    assert main([*argv, "--first-bucket-cap", "1MB", "--out", str(first)]) == 0
    # Ready order is the reverse definition order: the small first bucket gets 2, then 1.
    assert BucketPlan.from_json(first.read_text()).buckets == ((2, 1), (0,))


def test_plan_json_for_a_zoo_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "mlp", "--mode", "initial", "--json"]) == 0
    plan = BucketPlan.from_json(capsys.readouterr().out)
    assert len(plan.buckets) == 1  # DDP's first iteration: one bucket for all


def test_plan_bad_sizes_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--sizes", "[4, -1]"]) == 2
    assert "nbytes[1] = -1" in capsys.readouterr().err


def test_backends_lists_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "torch", "jax"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["torch", "available"]
    assert lines[1].split() == ["jax", "available"]
    assert main(["backends", "nope"]) == 2
    assert "unknown xgrad backend 'nope'; known backends:" in capsys.readouterr().out


def test_plan_units_and_ddp_first_bucket(capsys: pytest.CaptureFixture[str]) -> None:
    """2048B and 0.001953125 (MB) are one cap; it fills the first bucket too (two buckets)."""
    assert main(["plan", "--bucket-cap", "2048B", "--json"]) == 0
    by_suffix = BucketPlan.from_json(capsys.readouterr().out)
    assert main(["plan", "--bucket-cap-mb", "0.001953125", "--json"]) == 0
    assert BucketPlan.from_json(capsys.readouterr().out) == by_suffix
    assert by_suffix.buckets == ((5, 4, 3, 2), (1, 0)) and by_suffix.limits == (2048, 2048)


def test_plan_table_shows_an_unbounded_cap_as_infinity(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    csv_path = tmp_path / "plan.csv"
    assert main(["plan", "--mode", "initial", "--csv", str(csv_path)]) == 0
    text = capsys.readouterr().out
    assert "∞" in text and "9223372036854775807" not in text
    rows = csv_path.read_text().splitlines()
    assert rows[0] == "bucket,params,bytes,limit,members"
    assert rows[1].startswith("0,6,7456,inf,layers.0.weight")
    assert main(["plan", "--csv"]) == 0  # no FILE: the CSV instead of the text
    assert capsys.readouterr().out.startswith("bucket,params,bytes,limit,members\n0,")


#: (argv, the message the last line of stderr holds) of each bad command line.
BAD_INPUT: list[tuple[list[str], str]] = [
    (["plan", "--sizes", "[[1]]"], "xgrad plan: error: --sizes: size of '0' is [1]"),
    (["plan", "--bucket-cap", "25XB"], "argument --bucket-cap/--bucket-cap-mb: '25XB' is not"),
    (["plan", "--out", "/no/such/folder/p.json"], "argument --out: folder '/no/such/folder'"),
    (["crosscheck", "--backends", ","], "xgrad crosscheck: error: --backends ',' names no"),
    (["crosscheck", "--world-size", "0"], "argument --world-size: 0 is not >= 1"),
    # Was a thread per simulated rank until "can't start new thread", exit 1, 74 s later.
    (
        ["crosscheck", "--backends", "reference", "--world-size", "100000"],
        "argument --world-size: 100000 is more than reference takes (at most 1024",
    ),
    # Forked a gloo process per rank until memory ran out: the limit is the memory.
    (
        ["crosscheck", "--backends", "torch", "--world-size", "100000"],
        "argument --world-size: 100000 is more than torch-xgrad takes (at most",
    ),
    (["schedule", "gpipe", "-p", "2", "-m", "2", "--costs", "F=nan"], "'F': expected a"),
    # Each finite, their sum not (was "step time: inf", "bubble fraction: nan").
    (["schedule", "1f1b", "-p", "2", "-m", "4", "--costs", "F=1e308,B=1e308"], "past the l"),
    # Past int64: accepted, then PyTorch's DDP failed with a page of pybind traceback.
    (["crosscheck", "--bucket-cap", "9000000000GB"], "a size must be at most 2**63 - 1"),
    # Was accepted, and memory grew without end.
    (["schedule", "1f1b", "-p", "2", "-m", "1000000000"], "schedule too large: num_st"),
    (["bench", "graph", "--nodes", "x"], "argument --nodes"),
    (["crosscheck", "--seed", "-1"], "argument --seed: -1 is not >= 0"),
    # The whole batch is made before any backend runs: NumPy's MemoryError traceback.
    (
        ["crosscheck", "--backends", "reference", "--batch-per-rank", "100000000000"],
        "--world-size 2 x --batch-per-rank 100000000000 = 200000000000 samples of 'mlp'",
    ),
    (["bench", "ddp", "--models", ","], "xgrad bench ddp: error: --models ',' names no model"),
    (["schedule", "gpipe", "-p", "2", "-m", "2", "--png", "/no/such/dir/t.png"], "--png: "),
    # Results folders that cannot be made: refused before the run, not after it.
    (
        ["crosscheck", "--backends", "reference", "--out", "/proc/xg"],
        "xgrad crosscheck: error: [Errno 2] No such file or directory: '/proc/xg'",
    ),
    (["experiment", "run", "pipeline-bubble", "--quick", "--out", "/dev/null/x"], "--out: ca"),
    # A file that cannot be written once the run is done (/proc takes no new entry).
    (
        [
            "bench",
            "graph",
            "--nodes",
            "8",
            "--edges",
            "8",
            "--no-baseline",
            "--json",
            "/proc/g",
        ],
        "xgrad bench graph: error: [Errno 2] No such file or directory: '/proc/g'",
    ),
]


def _run_cli(argv: list[str]) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-m", "xgrad.cli", *argv], capture_output=True, text=True, env=env
    )


@pytest.fixture(scope="module")
def bad_input_runs() -> Iterator[list[Future[subprocess.CompletedProcess[str]]]]:
    """Every bad command line's run, two at a time: each is an interpreter of its own
    (some import torch), one after the other they took most of this file's time while a
    second core idled. Each test waits for its own."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(_run_cli, argv) for argv, _ in BAD_INPUT]
        yield runs
        for run in runs:
            run.cancel()


@pytest.mark.parametrize(("case", "argv", "message"), [(i, *c) for i, c in enumerate(BAD_INPUT)])
def test_bad_input_is_one_line_naming_the_option(
    bad_input_runs: list[Future[subprocess.CompletedProcess[str]]],
    case: int,
    argv: list[str],
    message: str,
) -> None:
    """As a user runs it: no traceback, the last line names the option, exit status 2."""
    done = bad_input_runs[case].result(timeout=300)
    assert done.args[3:] == argv
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert message in done.stderr.strip().splitlines()[-1], done.stderr


def test_value_errors_of_a_command_are_one_line_from_the_entry_point(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.argv", ["xgrad", "bench", "graph", "--nodes", "-5"])
    monkeypatch.delenv("XGRAD_TRACEBACK", raising=False)
    assert main() == 2
    assert capsys.readouterr().err.startswith("xgrad bench graph: error: ")


def test_every_option_has_a_help_line_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("crosscheck", "plan", "backends", "schedule", "bench"):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = capsys.readouterr().out
        assert "options:" in text, name
    with pytest.raises(SystemExit):
        main(["crosscheck", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--seed SEED seeds the weights and the batch (default: 0)" in text
    assert "(default: 2048B)" in text and "--world-size WORLD_SIZE ranks (default: 2)" in text


def test_backends_lists_runners_and_writes_json_and_csv(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import csv
    import json

    assert main(["backends", "reference", "--json", str(tmp_path / "b.json")]) == 0
    text = capsys.readouterr().out
    assert "runners" in text and "allreduce,fp16,bf16" in text
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["backends"] == [{"backend": "reference", "status": "available"}]
    assert [r["runner"] for r in data["runners"]] == ["reference"]
    assert main(["backends", "reference", "--csv"]) == 0
    rows = list(csv.DictReader(capsys.readouterr().out.splitlines()))
    assert [r["table"] for r in rows] == ["backends", "runners"]


def test_schedule_writes_its_figures_as_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import json

    out = tmp_path / "s.json"
    assert main(["schedule", "1f1b", "-p", "2", "-m", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    figures = {row["figure"]: row["value"] for row in data["figures"]}
    assert figures["bubble_fraction"] == pytest.approx(1 / 5)  # (p - 1) / (m + p - 1)
    assert [row["rank"] for row in data["ranks"]] == [0, 1]
    assert len(data["timeline"]) == 2 * 4 * 2  # a forward and a backward per microbatch and rank


@pytest.mark.parametrize(
    ("path", "argv", "option", "expected"),
    [
        ("xgrad.torch_backend.dist_autograd_bench", [], "size", 256),
        ("xgrad.torch_backend.dist_autograd_bench", ["--quick"], "size", 8),
        ("xgrad.torch_backend.dist_autograd_bench", ["--quick", "--iters", "5"], "iters", 5),
        ("xgrad.torch_backend.faults_bench", [], "worlds", [2, 3]),
        ("xgrad.torch_backend.faults_bench", ["--quick"], "worlds", [2]),
        ("xgrad.torch_backend.faults_bench", ["--quick", "--worlds", "3"], "worlds", [3]),
    ],
)
def test_quick_shrinks_only_the_options_not_given(
    path: str, argv: list[str], option: str, expected: object
) -> None:
    """``--quick`` used to overwrite ``--iters 5`` or ``--worlds 3`` silently; now it only
    changes the defaults, so an explicit option runs what it says."""
    import importlib

    from xgrad.cli import build_module_parser
    from xgrad.help_format import settle_quick

    parser = build_module_parser(importlib.import_module(path), "xgrad bench")
    assert getattr(settle_quick(parser.parse_args(argv)), option) == expected


def test_an_experiment_option_given_with_quick_is_what_runs(tmp_path: Path) -> None:
    from xgrad.experiments.runner import run_experiment

    code, report = run_experiment(
        "bucket-size", ["--quick", "--layers", "12", "--out", str(tmp_path / "given")]
    )
    assert code == 0 and report is not None
    assert report.config["layers"] == 12  # --quick used to cut it to 8
    _, quick = run_experiment("bucket-size", ["--quick", "--out", str(tmp_path / "quick")])
    assert quick is not None and quick.config["layers"] == 8


def test_the_help_shows_both_defaults_of_a_quick_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "dist-autograd", "--help"])
    assert "(default: 256; with --quick 8)" in " ".join(capsys.readouterr().out.split())


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """`xgrad schedule ... | head`: no traceback and no error line once the reader has gone."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    # Far more than a pipe holds, so the command is still writing when the reader leaves.
    argv = ["schedule", "gpipe", "-p", "8", "-m", "1000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "xgrad.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"gpipe: p=8 m=1000")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert err == ""


def test_python_m_xgrad_is_the_command() -> None:
    """``python -m xgrad`` said the package has no ``__main__``."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(
        [sys.executable, "-m", "xgrad", "schedule", "gpipe", "-p", "2", "-m", "2"],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "bubble fraction" in done.stdout


def test_crosscheck_timeout_holds_for_in_process_runners(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """JAX runs in this process: it was ``ok`` after seconds under --timeout 0.001."""
    pytest.importorskip("jax")
    argv = ["crosscheck", "--backends", "jax-jit,reference", "--timeout", "0.001"]
    assert main([*argv, "--steps", "1", "--no-progress", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "jax-jit: TIMEOUT jax-jit took " in out and "over the timeout of 0.001 s" in out
    assert "reference: TIMEOUT reference took " in out
    with pytest.raises(SystemExit):
        main(["crosscheck", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "seconds each runner's run (its warm-up and timed steps) may take" in text
