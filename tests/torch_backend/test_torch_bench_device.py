"""``xgrad bench ddp --device``: its checks run anywhere; the CUDA run needs a GPU.

The checks stand in for a GPU by patching ``torch.cuda``'s counts in this process only
(they run before any rank starts), so a machine without one tests what a machine with
one would refuse.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch

from xgrad.cli import main
from xgrad.torch_backend.ddp_bench_device import (
    BenchDevice,
    CudaMeter,
    CudaPeak,
    check_worlds,
    step_peak,
)
from xgrad.torch_backend.memory import HeapMeter


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Make this process see ``count`` CUDA devices (0: none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal without CUDA")
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--device cuda: no CUDA device is available here"):
        main(["bench", "ddp", "--device", "cuda", "--scale", "tiny", "--world-size", "1"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal without CUDA")
def test_cuda_without_a_gpu_is_one_line_from_the_entry_point(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a user runs it: one line naming the command, no traceback, exit status 2."""
    monkeypatch.setattr("sys.argv", ["xgrad", "bench", "ddp", "--device", "cuda"])
    monkeypatch.delenv("XGRAD_TRACEBACK", raising=False)
    assert main() == 2
    err = capsys.readouterr().err
    assert err.startswith("xgrad bench ddp: error: --device cuda: no CUDA device")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "3"], "--world-size 3 is more than the 2 CUDA device(s) here"),
        (["--world-size", "0"], "--world-size must be at least 1, got 0"),
        (
            ["--world-size", "1", "--wide-world-size", "4"],
            "--wide-world-size 4 is more than the 2 CUDA device(s) here",
        ),
        (["--world-size", "1", "--wide-world-size", "1"], "must be 0 (none) or >= 2, got 1"),
    ],
)
def test_cuda_world_sizes_are_checked_against_the_gpus(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str
) -> None:
    _gpus(monkeypatch, 2)
    with pytest.raises(ValueError, match=re.escape(message)):
        main(["bench", "ddp", "--device", "cuda", *argv])


def test_world_sizes_and_the_wide_default_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPU: a world of one times no communication; the wide row defaults to 4 ranks.
    assert check_worlds("cpu", 2, None) == (2, 4)
    assert check_worlds("cpu", 2, 0) == (2, 0)
    with pytest.raises(ValueError, match=re.escape("--world-size must be at least 2, got 1")):
        check_worlds("cpu", 1, 0)
    # CUDA with one GPU: a world of one is all NCCL can run; no wide row unless given.
    _gpus(monkeypatch, 1)
    assert check_worlds("cuda", 1, None) == (1, 0)
    with pytest.raises(ValueError, match=re.escape("--world-size 2 is more than the 1 CUDA")):
        check_worlds("cuda", 2, None)
    _gpus(monkeypatch, 4)
    assert check_worlds("cuda", 2, None) == (2, 0)
    assert check_worlds("cuda", 4, 4) == (4, 4)


def test_the_cpu_device_changes_nothing() -> None:
    device = BenchDevice("cpu", 1)
    assert device.ddp_kwargs == {} and device.torch == torch.device("cpu")
    assert isinstance(device.meter(), HeapMeter)
    model, x, _ = device.build("mlp", "tiny")
    assert x.device.type == "cpu" and next(model.parameters()).device.type == "cpu"
    device.finish()  # nothing to wait for
    # On CUDA both DDPs are told their rank's GPU (constructing this touches no GPU).
    assert BenchDevice("cuda", 1).ddp_kwargs == {"device_ids": [1]}


def test_step_peak_on_the_cpu_heap_is_never_negative() -> None:
    def step(sample: object) -> None:
        assert callable(sample)
        torch.ones(1 << 16).sum()

    assert step_peak(HeapMeter(), lambda: None, step) >= 0


def test_cuda_peak_is_the_allocator_peak_above_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arithmetic of the CUDA meter, against a fake allocator (no GPU needed)."""
    state = {"now": 1000, "peak": 5000, "syncs": 0}

    def allocate(n: int) -> None:
        state["now"] += n
        state["peak"] = max(state["peak"], state["now"])

    def reset(device: object) -> None:
        state["peak"] = state["now"]

    def sync(device: object) -> None:
        state["syncs"] += 1

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: state["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    meter = CudaMeter(torch.device("cuda", 0))
    assert meter.live() == 1000

    def step(sample: object) -> None:
        allocate(300)  # the step's temporaries, freed before it ends...
        assert callable(sample)
        allocate(-300)
        allocate(20)  # ...and what it keeps (gradients)

    # The peak before the step (5000) does not count: it restarts at the step's start.
    assert step_peak(meter, lambda: None, step, steps=2) == 300
    assert state["syncs"] == 4  # before and after each step: the queued work is done
    with CudaPeak(meter) as watch:
        watch.sample()  # nothing to do: the allocator keeps the peak
        assert watch.measure(lambda: allocate(7)) == 7


def test_help_shows_the_device_and_the_wide_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "ddp", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--device {cpu,cuda}" in text and "(default: cpu)" in text
    assert "default 4 on cpu, 0 on cuda" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_runs_on_cuda(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    argv = ["bench", "ddp", "--device", "cuda", "--scale", "tiny", "--world-size", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "xgrad DDP vs torch DDP: NCCL on CUDA," in printed
    rows = json.loads(out.read_text())["bench ddp"]
    # Every model, both find_unused settings, and no wide row (its default is 0 on CUDA).
    assert len(rows) == 8 and all(r["world"] == 1 and r["steps"] == 6 for r in rows)
    assert all(r["xgrad_step"] > 0 and r["torch_step"] > 0 and r["local_step"] > 0 for r in rows)
    assert all(r["xgrad_memory"] >= 0 and r["torch_memory"] >= 0 for r in rows)
    assert all(r["hook_seconds"] >= 0 for r in rows)
