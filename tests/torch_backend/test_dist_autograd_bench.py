"""``xgrad bench dist-autograd`` end to end at tiny sizes: the same gradients as PyTorch's RPC.

Its speed is not tested here (the bench reports it); the gradients of xgrad's
distributed backward and of ``torch.distributed.autograd`` over RPC on the same graph
(a chain through the ranks, a fan-out, a round trip back
to rank 0, fan-ins) must agree.
"""

from __future__ import annotations

import csv
import json
import pathlib
from typing import Any

import pytest

from xgrad.cli import main

torch = pytest.importorskip("torch")


def test_bench_reports_a_ratio_and_equal_gradients(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.rpc as rpc

    if not rpc.is_available():
        pytest.skip("torch.distributed.rpc is not available in this build of torch")
    argv = ["bench", "dist-autograd", "--quick", "--world", "3", "--dtype", "float64", "--ab"]
    files = ["--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv")]
    assert main([*argv, "--timeout", "180", *files]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("backward "))
    torch_ms, xgrad_ms, ratio = (float(v) for v in row.split()[1:4])
    assert torch_ms > 0 and xgrad_ms > 0
    # The ratio is the median of the block ratios (two blocks of one pass here), with its
    # interval, the verdict and the one launch's median.
    low, high = (float(v) for v in row.split("[")[1].split("]")[0].split(", "))
    assert low <= ratio <= high
    verdict, launches = row.split("]")[1].split()
    # Two blocks in one launch are too few for a 95% interval: the bracket is their range,
    # said so, and no verdict is claimed from it (it read "95% interval" and met/missed).
    assert verdict == "too-few" and float(launches) == ratio
    assert "range of 2" in lines[0] and "not judged" in lines[0] and "95% interval" not in lines[1]
    diff = next(line for line in lines if line.startswith("largest gradient difference"))
    assert float(diff.rsplit(" ", 1)[1]) < 1e-12
    # The other execution (waves or nodes), timed in the same blocks: figure and gradients.
    ab = next(line for line in lines if line.startswith("A/B, same blocks"))
    assert float(ab.split("gradient difference ")[1].split(")")[0]) < 1e-12
    (ab_record,) = json.loads((tmp_path / "r.json").read_text())[
        "bench dist-autograd waves vs nodes"
    ]
    assert ab_record["ratio"] == pytest.approx(ab_record["waves_ms"] / ab_record["nodes_ms"])
    # The same figures as JSON and CSV, unrounded.
    (record,) = json.loads((tmp_path / "r.json").read_text())["bench dist-autograd"]
    assert record["world"] == 3 and record["dtype"] == "float64" and record["launches"] == 1
    assert (record["ratio_low"], record["ratio"], record["ratio_high"]) == pytest.approx(
        (low, ratio, high), abs=1e-3
    )
    assert record["verdict"] == verdict and record["launch_ratios"] == launches
    assert record["torch_rpc_ms"] == pytest.approx(torch_ms, abs=1e-3)
    # CPU per pass, all ranks: both measured, the printed row the same figures.
    cpu = next(line for line in lines if line.startswith("cpu "))
    torch_cpu, xgrad_cpu, cpu_ratio = (float(v) for v in cpu.split()[1:4])
    assert record["torch_rpc_cpu_ms"] > 0 and record["xgrad_cpu_ms"] > 0
    assert (torch_cpu, xgrad_cpu) == pytest.approx(
        (record["torch_rpc_cpu_ms"], record["xgrad_cpu_ms"]), abs=1e-3
    )
    assert record["cpu_ratio"] == pytest.approx(record["xgrad_cpu_ms"] / record["torch_rpc_cpu_ms"])
    assert cpu_ratio == pytest.approx(record["cpu_ratio"], abs=1e-3)
    # Rank 0's whole pass (forward, backward, the context's end) outlasts its backward.
    whole = next(line for line in lines if line.startswith("pass "))
    torch_pass, xgrad_pass, pass_ratio = (float(v) for v in whole.split()[1:4])
    assert torch_pass > torch_ms and xgrad_pass > xgrad_ms
    assert pass_ratio == pytest.approx(xgrad_pass / torch_pass, rel=1e-2)
    assert record["pass_ratio"] == pytest.approx(
        record["xgrad_pass_ms"] / record["torch_rpc_pass_ms"]
    )
    assert (torch_pass, xgrad_pass) == pytest.approx(
        (record["torch_rpc_pass_ms"], record["xgrad_pass_ms"]), abs=1e-3
    )
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    (csv_row,) = [row for row in rows if row["table"] == "bench dist-autograd"]
    assert float(csv_row["max_grad_diff"]) == record["max_grad_diff"] < 1e-12


def test_bench_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="--world must be >= 2"):
        main(["bench", "dist-autograd", "--world", "1"])
    with pytest.raises(ValueError, match="--iters must be >= 1, got 0"):
        main(["bench", "dist-autograd", "--iters", "0"])
    with pytest.raises(ValueError, match="--warmup must be >= 0, got -1"):
        main(["bench", "dist-autograd", "--warmup", "-1"])
    with pytest.raises(ValueError, match=r"--timeout must be > 0 seconds, got -1\.0"):
        main(["bench", "dist-autograd", "--timeout", "-1"])
    with pytest.raises(SystemExit):  # argparse's one-line error, before any process starts
        main(["bench", "dist-autograd", "--csv", "no/such/folder/r.csv"])


def _count_fetches(rank: int, world: int, cfg: dict[str, Any]) -> Any:
    """The bench's worker with its CPU clock replaced by a count of this process's remote
    gradient fetches (``_rpc_grad`` calls): its CPU figures then count the fetches in the
    timed windows."""
    import time
    import types

    import torch.distributed.rpc as rpc

    from xgrad.torch_backend import dist_autograd_bench as bench

    fetches = [0]
    sync = rpc.rpc_sync

    def counting(to: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        fetches[0] += func is bench._rpc_grad
        return sync(to, func, *args, **kwargs)

    rpc.rpc_sync = counting
    bench.time = types.SimpleNamespace(  # type: ignore[assignment]
        perf_counter=time.perf_counter, process_time=lambda: float(fetches[0])
    )
    return bench._worker(rank, world, cfg), fetches[0]


def test_the_cpu_per_pass_leaves_out_fetching_the_gradients_for_the_check(
    tmp_path: pathlib.Path,
) -> None:
    # PyTorch's remote gradients are fetched (one RPC per rank) only to compare them with
    # xgrad's: neither forward nor backward, so not in the timed CPU the row reports.
    import torch.distributed.rpc as rpc

    from xgrad.torch_backend.spawn import spawn

    if not rpc.is_available():
        pytest.skip("torch.distributed.rpc is not available in this build of torch")
    cfg = {
        "size": 4, "batch": 2, "iters": 2, "warmup": 1, "dtype": "float64", "timeout": 60.0,
        "rounds": 1, "rpc_init": f"file://{tmp_path}/rpc", "execute": "nodes", "ab": False,
    }  # fmt: skip
    (result, fetched), *_ = spawn(_count_fetches, 2, args=(cfg,), timeout=120.0)
    assert fetched > 0  # the gradients were still fetched, and compared
    assert result["diff"] < 1e-12
    assert result["torch_cpu"] == 0.0 and result["xgrad_cpu"] == 0.0


def _launch(xgrad: list[float], theirs: list[float], blocks: list[int]) -> dict[str, Any]:
    """One launch's results as the worker returns them (pass = twice the backward)."""
    return {
        "xgrad_times": xgrad,
        "torch_times": theirs,
        "blocks": blocks,
        "diff": 1e-15,
        "xgrad_pass_times": [2 * t for t in xgrad],
        "torch_pass_times": [2 * t for t in theirs],
        "xgrad_cpu": 1.0,
        "torch_cpu": 2.0,
    }


def test_each_block_is_judged_against_the_torch_block_after_it() -> None:
    from xgrad.torch_backend.dist_autograd_report import summarize

    # The machine slowed twofold for the second block of both: pairing cancels it.
    one = _launch([1.0, 2.0, 2.0, 2.0], [2.0, 4.0, 4.0, 4.0], [1, 3])
    s = summarize([one])
    assert s.ratio == (0.5, 0.5, 0.5) and s.launches == ((0.5, 0.5, 0.5),)
    assert s.backward == (4.0, 2.0) and s.whole == (8.0, 4.0) and s.cpu == (2.0, 1.0)
    assert s.verdict == "too-few" and s.other is None  # two blocks: no 95% interval
    assert s.turns == 2 and s.pooled == 2
    # Six blocks a launch: judged. Ratios 0.9 and 1.1: 1.00 inside the launch's interval.
    six = _launch([1.0] * 6, [2.0] * 6, [1] * 6)
    assert summarize([six]).verdict == "met"
    mixed = _launch([0.9, 1.1] * 3, [1.0] * 6, [1] * 6)
    assert summarize([mixed]).verdict == "noise"


def test_six_launches_are_judged_by_their_median_block_ratios() -> None:
    from xgrad.torch_backend.dist_autograd_report import summarize

    # Each launch has one block above 1.00 and three below: every median is below.
    below = [_launch([0.9, 0.95, 0.97, 1.05], [1.0] * 4, [1, 1, 1, 1]) for _ in range(6)]
    assert summarize(below).verdict == "met"
    above = [_launch([1.2, 1.25, 1.3, 0.9], [1.0] * 4, [1, 1, 1, 1]) for _ in range(6)]
    assert summarize(above).verdict == "missed"
    assert summarize([*below[:5], above[0]]).verdict == "noise"
    with pytest.raises(ValueError, match="no launches"):
        summarize([])
