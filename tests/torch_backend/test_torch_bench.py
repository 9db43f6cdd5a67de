"""``xgrad bench ddp`` runs end to end at a tiny size (its speed is not tested here)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from xgrad.cli import main
from xgrad.torch_backend.bench import CaseResult, table

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_prints_one_row_per_case(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.json"
    args = ["bench", "ddp", "--scale", "tiny", "--models", "mlp,many"]
    args += ["--rounds", "2", "--iters", "2", "--warmup", "1", "--json", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert printed.count("| mlp |") == 2 and printed.count("| many |") == 2
    rows = json.loads(out.read_text())
    assert [(r["model"], r["find_unused"]) for r in rows] == [
        ("mlp", False),
        ("mlp", True),
        ("many", False),
        ("many", True),
    ]
    assert all(r["xgrad_step"] > 0 and r["torch_step"] > 0 for r in rows)
    assert rows[2]["tensors"] > 200  # the many-small-tensors model


def test_table_shows_ratios() -> None:
    row = CaseResult("mlp", True, 6, 100, 0.0021, 0.002, 3 * 2**20, 2 * 2**20, 5e-6)
    text = table([row])
    assert "| mlp | yes | 6 | 2.10 | 2.00 | 1.050 | 3.00 | 2.00 | 1.500 | 5.0 |" in text


def test_unknown_model_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown model\(s\) \['resnet'\]"):
        main(["bench", "ddp", "--models", "resnet"])


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
