"""``xgrad bench pipeline`` runs end to end at tiny sizes (its speed is not tested)."""

from __future__ import annotations

import pytest

from xgrad.cli import main

pytest.importorskip("torch")


def test_bench_prints_ratios_bubbles_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "pipeline", "-p", "2", "-m", "2", "--batch", "4", "--width", "4"]
    assert main([*argv, "--layers", "1", "--steps", "1", "--warmup", "0", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in ("gpipe", "1f1b"):
        row = next(line for line in lines if line.startswith(f"{name} ") and "measured" not in line)
        torch_t, ours_t, ratio = (float(v) for v in row.split()[1:4])
        assert ratio == pytest.approx(ours_t / torch_t, rel=1e-2)
        bubble = next(line for line in lines if line.startswith(f"{name} ") and "measured" in line)
        assert "equal-cost 0.333" in bubble  # (p-1)/(m+p-1) for p = m = 2
    assert "peak memory per stage, MiB (heap: C heap in use above the step's start (" in out
    for stage in (0, 1):
        line = next(line for line in lines if line.startswith(f"stage {stage}: "))
        cells = dict(zip(("gpipe", "1f1b"), line.split(": ", 1)[1].split(" | "), strict=True))
        for name, cell in cells.items():
            assert cell.startswith(f"{name} ")
            figures = dict(item.split("=") for item in cell[len(name) + 1 :].split(", "))
            assert list(figures) == ["torch_heap", "xgrad_heap", "xgrad_activation"]
            for figure in figures.values():
                assert figure.endswith(" MiB") and float(figure.removesuffix(" MiB")) >= 0


def test_bench_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="--batch 5 is not a multiple of --microbatches 2"):
        main(["bench", "pipeline", "-m", "2", "--batch", "5"])
    with pytest.raises(ValueError, match="--stages must be >= 2"):
        main(["bench", "pipeline", "-p", "1"])
