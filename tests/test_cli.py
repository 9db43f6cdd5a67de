"""The ``xgrad`` command's dispatcher and the core subcommands (plan, backends)."""

from __future__ import annotations

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
    assert "3 parameters, 6000100 bytes, 2 buckets" in text
    # Ready order is the reverse definition order: the small first bucket gets 2, then 1.
    plan = BucketPlan.from_json(out.read_text())
    assert plan.buckets == ((2, 1), (0,))


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
