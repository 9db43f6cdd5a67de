"""The crosscheck: metrics, tolerances, the compression model, runners, skips, exit status."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from xgrad import backend, crosscheck
from xgrad.backend import Step, unsupported_by_declaration
from xgrad.crosscheck import Case, RunResult

pytest.importorskip("torch")


def test_ulp_distance_counts_representable_steps() -> None:
    one = np.array([1.0], dtype=np.float32)
    up = np.nextafter(one, np.float32(2))
    assert crosscheck.ulp_distance(one, np.array([1.0])) == 0
    assert crosscheck.ulp_distance(up, np.array([1.0])) == 1
    down2 = np.nextafter(np.nextafter(one, np.float32(0)), np.float32(0))
    assert crosscheck.ulp_distance(down2, np.array([1.0])) == 2
    # Across zero: the smallest subnormals either side are two steps apart.
    tiny = np.array([np.nextafter(np.float32(0), np.float32(1))])
    assert crosscheck.ulp_distance(-tiny, tiny.astype(np.float64)) == 2
    # The reference is rounded to the dtype first: 1 + 2**-30 rounds to 1.0f.
    assert crosscheck.ulp_distance(one, np.array([1.0 + 2.0**-30])) == 0
    half = np.array([1.0], dtype=np.float16)
    assert crosscheck.ulp_distance(half, np.array([1.0 + 2.0**-10])) == 1
    assert crosscheck.ulp_distance(np.array([np.nan], np.float32), np.array([1.0])) > 2**40


def test_bit_identical_means_the_same_bits() -> None:
    from xgrad.crosscheck.metrics import bit_identical

    a = np.array([0.0, 1.5, -2.0], dtype=np.float32)
    assert bit_identical(a, a.copy())
    assert bit_identical(a[::2], np.array([0.0, -2.0], dtype=np.float32))  # strided
    assert not bit_identical(a, np.array([-0.0, 1.5, -2.0], dtype=np.float32))  # -0.0
    assert not bit_identical(a, a.astype(np.float64))  # equal values, another dtype
    assert not bit_identical(a, a.reshape(3, 1))


def test_rel_is_relative_to_the_largest_reference_element() -> None:
    ref = np.array([10.0, 1e-9, 0.0])
    got = np.array([10.0, 2e-9, 1e-6], dtype=np.float64)
    m = crosscheck.compare("w", got, ref, tol=1e-6)
    assert m.max_abs == pytest.approx(1e-6)
    assert m.rel == pytest.approx(1e-7)
    assert m.passed
    zero = crosscheck.compare("b", np.array([0.0, 3e-7]), np.zeros(2), tol=1e-6)
    assert zero.rel == pytest.approx(3e-7) and zero.passed
    assert not crosscheck.compare("c", np.array([1.1]), np.array([1.0]), tol=1e-6).passed
    with pytest.raises(ValueError, match=r"gradient of 'w' has shape \(2,\), expected \(3,\)"):
        crosscheck.compare("w", np.zeros(2), np.zeros(3), tol=1.0)


def test_tolerances_per_dtype_and_hook() -> None:
    assert crosscheck.tolerance("float32") == 1e-6
    assert crosscheck.tolerance("float64") == 1e-12
    assert crosscheck.tolerance("float32", "fp16") == 2e-3
    assert crosscheck.tolerance("float32", "allreduce") == 1e-6
    assert crosscheck.tolerance("bfloat16", "fp16") == 5e-2
    assert crosscheck.tolerance("float32", "powersgd") == pytest.approx(1e-5)


def test_compression_model_rounds_per_rank_then_sums_in_the_wire_dtype() -> None:
    # float16 steps by 2**-10 near 1, ties to even: 1 + 2**-11 -> 1.0, 1 + 3 * 2**-11 -> 1 + 2**-9.
    a = {"w": np.array([1.0 + 2.0**-11, 3.0])}
    b = {"w": np.array([1.0 + 3 * 2.0**-11, 5.0])}
    out = crosscheck.compression_model([a, b], "fp16", "float32")
    assert out["w"].dtype == np.float32
    assert out["w"].tolist() == [(1.0 + (1.0 + 2.0**-9)) / 2, 4.0]


def test_case_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        Case(world_size=0)
    with pytest.raises(ValueError, match="hook='topk'"):
        Case(hook="topk")
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        Case(model="vgg")
    with pytest.raises(ValueError, match="timeout=0"):
        Case(timeout=0)
    with pytest.raises(ValueError, match=r"unknown backends \['nccl'\]"):
        crosscheck.run_crosscheck(Case(), backends=["nccl"])


def test_the_shared_plan_is_capped_and_launched_in_reverse() -> None:
    inputs = crosscheck.make_inputs(Case(bucket_cap_bytes=2048))
    # layers.0.weight alone fills 2048 B; then (bias 0, weight 1); then the rest. Reversed.
    assert inputs.plan.buckets == ((3, 4, 5), (1, 2), (0,))
    assert inputs.x.shape == (8, 16)


def _perturbed(step: Step) -> RunResult:
    from xgrad.torch_backend.models import single_process_grads

    grads = single_process_grads(step.model, step.weights, step.x, step.y)
    grads = {k: v.astype(np.float32) for k, v in grads.items()}
    grads["layers.1.bias"] = grads["layers.1.bias"] * np.float32(1.001)
    return RunResult(grads, 0.001, step.plan)


class _Runner:
    """A runner made of a function, for backends registered by these tests."""

    hooks: tuple[str, ...] = ("allreduce",)
    dtypes: tuple[str, ...] = ("float32",)

    def __init__(self, name: str, description: str, run) -> None:  # type: ignore[no-untyped-def]
        self.name, self.description, self.run = name, description, run

    def unsupported(self, step: Step) -> str | None:
        return unsupported_by_declaration(self, step)


def _register(monkeypatch: pytest.MonkeyPatch, name: str, target: object) -> None:
    monkeypatch.setattr(backend, "_REGISTRY", {**backend._REGISTRY, name: target})


def _fake(name: str, runners: list[_Runner], ok: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        name=name,
        available=lambda: ok,
        runners=lambda: runners,
        run_ranks=None,
        array_ops=lambda: None,
    )


def test_a_wrong_backend_fails_and_a_missing_one_is_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _register(monkeypatch, "off", _fake("off", [_Runner("off", "gradients 0.1% off", _perturbed)]))
    _register(monkeypatch, "absent", "xgrad_no_such_module")
    report = crosscheck.run_crosscheck(Case(steps=1), backends=["off", "absent", "reference"])
    status = {b.name: b.status for b in report.backends}
    assert status == {"off": "fail", "absent": "skipped", "reference": "ok"}
    assert not report.ok
    off = report.backends[0]
    assert [m.name for m in off.params if not m.passed] == ["layers.1.bias"]
    assert "layers.1.bias: rel" in off.reason
    assert [m.passed for m in off.buckets] == [False, True, True]  # (3,4,5), (1,2), (0,)
    assert "No module named 'xgrad_no_such_module'" in report.backends[1].reason
    text = crosscheck.format_report(report)
    assert "<-- beyond tolerance" in text and text.endswith("FAIL")
    # The step times' column says what it is (a step, not a DDP's rebuild among four).
    assert "ms/step: mean wall time of the timed steps (1), one run each" in text
    five = " ".join(
        crosscheck.format_report(dataclasses.replace(report, case=Case(steps=5))).split()
    )
    assert "timed steps (5; a DDP's all but its first, which rebuilds its buckets)" in five
    json_path, csv_path = crosscheck.write_outputs(report, tmp_path)
    data = json.loads(json_path.read_text())
    assert data["ok"] is False and data["plan"]["buckets"] == [[3, 4, 5], [1, 2], [0]]
    rows = list(csv.DictReader(csv_path.open()))
    assert {r["backend"] for r in rows} == {"off", "absent", "reference"}
    assert [r["name"] for r in rows if r["backend"] == "off" and r["passed"] == "0"] == [
        "layers.1.bias",
        "bucket 0 [3,4,5]",
    ]


def test_a_raising_backend_is_an_error_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(step: Step) -> RunResult:
        raise RuntimeError(f"rank 1 lost (world size {step.world_size})")

    _register(monkeypatch, "boom", _fake("boom", [_Runner("boom", "raises", boom)]))
    report = crosscheck.run_crosscheck(Case(steps=1), backends=["boom"])
    assert report.backends[0].status == "error"
    assert report.backends[0].reason == "RuntimeError: rank 1 lost (world size 2)"
    assert not report.ok


def test_a_runner_past_the_timeout_is_reported_as_timed_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An in-process runner cannot be stopped part way: it ran to its end and was ``ok``
    after taking far longer than the timeout. It is now ``timeout``, unmeasured, naming
    itself, the limit and the time; the runner after it still runs as usual."""
    import time

    def slow(step: Step) -> RunResult:
        time.sleep(0.3)
        return _perturbed(step)

    _register(monkeypatch, "slow", _fake("slow", [_Runner("slow", "sleeps", slow)]))
    report = crosscheck.run_crosscheck(Case(steps=1, timeout=0.1), backends=["slow", "reference"])
    late, after = report.backends
    assert late.status == "timeout" and not late.params and not late.grads
    assert late.reason.startswith("slow took 0.3") and "over the timeout of 0.1 s" in late.reason
    assert after.status == "ok"
    assert not report.ok and not report.nothing_ran
    text = crosscheck.format_report(report)
    assert "slow: TIMEOUT slow took" in text and text.endswith("FAIL")
    data = json.loads(crosscheck.write_outputs(report, tmp_path)[0].read_text())
    assert [b["status"] for b in data["backends"]] == ["timeout", "ok"]


def test_a_runner_that_raises_past_the_timeout_is_timed_out_with_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time

    def late_boom(step: Step) -> RunResult:
        time.sleep(0.2)
        raise RuntimeError("spawn timed out")

    _register(monkeypatch, "lb", _fake("lb", [_Runner("lb", "raises late", late_boom)]))
    report = crosscheck.run_crosscheck(Case(steps=1, timeout=0.05), backends=["lb"])
    (late,) = report.backends
    assert late.status == "timeout"
    assert late.reason.endswith("over the timeout of 0.05 s: RuntimeError: spawn timed out")


def test_a_world_too_large_for_the_reference_is_refused_before_anything_runs() -> None:
    from xgrad.reference.rank_threads import MAX_RANKS

    # Was a thread per rank started until "can't start new thread", minutes later.
    with pytest.raises(crosscheck.WorldSizeError, match=f"at most {MAX_RANKS}") as err:
        crosscheck.run_crosscheck(Case(world_size=MAX_RANKS + 1), backends=["reference"])
    assert err.value.world_size == MAX_RANKS + 1 and err.value.runner == "reference"


def test_no_attribution_when_nothing_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """The PowerSGD attribution line ("backends are measured against ...") was printed
    although every backend was skipped: nothing was measured."""
    _register(monkeypatch, "absent", "xgrad_no_such_module")
    report = crosscheck.run_crosscheck(Case(steps=1, hook="powersgd"), backends=["absent"])
    assert report.nothing_ran and report.attribution == []
    assert "attribution" not in crosscheck.format_report(report)


def test_a_malformed_answer_is_that_backends_error_not_a_crash_nor_a_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wrong shape, a non-array or no StepResult ended the whole crosscheck with an
    exception; float64 gradients for a float32 case passed as if computed in float32."""

    def answer(change: Any) -> Any:
        def run(step: Step) -> Any:
            good = _perturbed(step)
            return change(dict(good.grads))

        return run

    bad = {
        "flat": lambda g: RunResult({**g, "layers.0.weight": g["layers.0.weight"].ravel()}, 0.1),
        "wide": lambda g: RunResult({k: v.astype(np.float64) for k, v in g.items()}, 0.1),
        "listed": lambda g: RunResult({k: v.tolist() for k, v in g.items()}, 0.1),
        "nothing": lambda g: None,
        "nan-time": lambda g: RunResult(g, float("nan")),
        "negative-time": lambda g: RunResult(g, -0.1),
    }
    runners = [_Runner(name, name, answer(change)) for name, change in bad.items()]
    _register(monkeypatch, "broken", _fake("broken", runners))
    report = crosscheck.run_crosscheck(Case(steps=1), backends=["broken", "reference"])
    reasons = {b.name: (b.status, b.reason) for b in report.backends}
    assert reasons["reference"] == ("ok", "")
    assert reasons["flat"] == (
        "error",
        "gradient of 'layers.0.weight' is float32[512], its parameter float32[32, 16]",
    )
    assert reasons["wide"] == (
        "error",
        "gradient of 'layers.0.weight' is float64[32, 16], its parameter float32[32, 16]",
    )
    assert reasons["listed"] == (
        "error",
        "gradient of 'layers.0.weight' is a list, not a numpy array",
    )
    assert reasons["nothing"] == (
        "error",
        "run() returned NoneType, not a StepResult with a grads dict",
    )
    assert reasons["nan-time"] == (
        "error",
        "seconds_per_step=nan is not a finite number of seconds >= 0",
    )
    assert reasons["negative-time"] == (
        "error",
        "seconds_per_step=-0.1 is not a finite number of seconds >= 0",
    )
    assert not report.ok


def test_a_plug_in_raising_in_available_runners_or_unsupported_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each of these ended every crosscheck with the plug-in's exception, even one that
    did not name it (available() is asked of every registered backend)."""

    def fails(what: str) -> Any:
        def raise_it(*args: Any) -> Any:
            raise RuntimeError(f"{what} broke")

        return raise_it

    asks = _fake("asks", [_Runner("asks-runner", "x", _perturbed)])
    asks.available = fails("available")
    lists = _fake("lists", [])
    lists.runners = fails("runners")
    judges = _Runner("judges", "x", _perturbed)
    judges.unsupported = fails("unsupported")  # type: ignore[method-assign]
    for name, target in (("asks", asks), ("lists", lists), ("judges", _fake("j", [judges]))):
        _register(monkeypatch, name, target)
    report = crosscheck.run_crosscheck(Case(steps=1), backends=["reference"])
    assert [(b.name, b.status) for b in report.backends] == [("reference", "ok")]
    report = crosscheck.run_crosscheck(Case(steps=1), backends=["asks", "lists", "judges"])
    assert [(b.name, b.status, b.reason) for b in report.backends] == [
        ("asks-runner", "skipped", "available() raised RuntimeError: available broke"),
        ("lists", "skipped", "runners() raised RuntimeError: runners broke"),
        ("judges", "error", "RuntimeError: unsupported broke"),
    ]


def test_an_unavailable_or_unsupporting_backend_is_skipped_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _register(monkeypatch, "later", _fake("later", [_Runner("later", "x", _perturbed)], ok=False))
    _register(monkeypatch, "f32", _fake("f32", [_Runner("f32-only", "x", _perturbed)]))
    report = crosscheck.run_crosscheck(Case(steps=1, dtype="float64"), backends=["later", "f32"])
    assert [b.status for b in report.backends] == ["skipped", "skipped"]
    assert report.backends[0].reason == "its available() says no"
    assert report.backends[1].reason == "f32-only runs float32 only, not float64"
    # Nothing was compared: the last line does not say PASS (it did, as on a machine
    # without CUDA under --device cuda).
    assert crosscheck.format_report(report).splitlines()[-1] == (
        "NOTHING RAN: every backend was skipped (see why above)"
    )
    with pytest.raises(ValueError, match="no backend named"):
        crosscheck.run_crosscheck(Case(steps=1), backends=[])


def test_the_command_exits_3_when_every_backend_was_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from xgrad.cli import main

    _register(monkeypatch, "later", _fake("later", [_Runner("later", "x", _perturbed)], ok=False))
    args = ["crosscheck", "--backends", "later", "--steps", "1", "--no-progress"]
    # Was 0, as for a pass: a CI job under --device cuda on a machine without a GPU passed.
    assert main([*args, "--out", str(tmp_path / "none")]) == 3
    assert capsys.readouterr().out.splitlines()[-2].startswith("NOTHING RAN")
    _register(monkeypatch, "now", _fake("now", [_Runner("now", "x", _perturbed)]))
    assert main([*args[:2], "later,now", *args[3:], "--out", str(tmp_path / "one")]) == 1


def test_jax_and_reference_within_float32_tolerance_and_fp16_attributed() -> None:
    pytest.importorskip("jax")
    plain = crosscheck.run_crosscheck(
        Case(steps=1), backends=["reference", "jax-pmap", "jax-shard_map"]
    )
    assert plain.ok and all(b.status == "ok" for b in plain.backends)
    assert all(m.rel <= 1e-6 for b in plain.backends for m in b.params)
    assert plain.attribution == []
    assert plain.agreement[0] == "bit-identical: jax-pmap = jax-shard_map"
    assert plain.agreement[1].startswith("reference vs jax-pmap: max rel")
    fp16 = crosscheck.run_crosscheck(Case(steps=1, hook="fp16"), backends=["jax-pmap"])
    assert fp16.ok
    worst = fp16.backends[0].worst
    assert worst is not None and 1e-6 < worst.rel <= 2e-3  # visible, and within the fp16 bound
    assert "jax-pmap: equal to the compression model, bit for bit" in fp16.attribution


@pytest.mark.slow
def test_default_command_passes_on_every_backend(tmp_path: Path) -> None:
    """The README's main command: every backend runs and is within 1e-6 of the reference."""
    from xgrad.cli import main

    pytest.importorskip("jax")
    pytest.importorskip("xgrad.torch_backend.crosscheck")
    assert main(["crosscheck", "--out", str(tmp_path), "--steps", "2"]) == 0
    data = json.loads((tmp_path / "crosscheck-mlp-ws2-float32-cap2048-nohook.json").read_text())
    assert [b["status"] for b in data["backends"]] == ["ok"] * len(crosscheck.runner_names())
    assert max(m["rel"] for b in data["backends"] for m in b["params"]) <= 1e-6


def test_pytorch_bf16_hook_is_skipped_on_cpu_with_the_reason() -> None:
    report = crosscheck.run_crosscheck(Case(hook="bf16", steps=1), backends=["torch-ddp"])
    assert report.backends[0].status == "skipped"
    assert "needs NCCL on CUDA" in report.backends[0].reason
    assert report.ok


@pytest.mark.slow
def test_fp16_difference_between_torch_and_jax_is_attributed_to_compression() -> None:
    pytest.importorskip("jax")
    pytest.importorskip("xgrad.torch_backend.crosscheck")
    report = crosscheck.run_crosscheck(
        Case(hook="fp16", steps=1), backends=["torch-xgrad", "jax-shard_map"]
    )
    assert [b.status for b in report.backends] == ["ok", "ok"]
    pair = [s for s in report.attribution if s.startswith("torch-xgrad vs jax-shard_map")]
    # Without a pair line the two were equal bit for bit (both on the compression model).
    for line in pair:
        assert "explained by rounding per-rank float32 gradients" in line
    if not pair:
        assert all(
            any(
                s == f"{name}: equal to the compression model, bit for bit"
                for s in report.attribution
            )
            for name in ("torch-xgrad", "jax-shard_map")
        ), report.attribution
    for name in ("torch-xgrad", "jax-shard_map"):
        within = next(s for s in report.attribution if s.startswith(f"{name}: "))
        ulps = 0.0 if "bit for bit" in within else float(within.split()[2])
        assert ulps <= 1.0  # at most one float16 step from the model


def test_powersgd_is_measured_against_its_model_not_the_exact_gradient() -> None:
    pytest.importorskip("jax")
    report = crosscheck.run_crosscheck(
        Case(hook="powersgd", steps=1),
        backends=["jax-shard_map", "torch-xgrad", "torch-ddp", "reference"],
    )
    jax_side, torch_side, torch_ddp, reference = report.backends
    assert len(report.plan.buckets) > 1
    # xgrad's DDP runs PowerSGD over several buckets on gloo; PyTorch's DDP would hang.
    assert jax_side.status == "ok" and torch_side.status == "ok" and report.ok
    assert report.truth.startswith("PowerSGD model")
    assert "PyTorch's DDP hangs with powerSGD_hook and several buckets" in torch_ddp.reason
    assert reference.reason == "reference runs hooks allreduce, fp16, bf16 only, not 'powersgd'"
    lossy = float(report.attribution[0].split("off by rel ")[1].split()[0])
    assert lossy > 0.1  # rank 1 is far from exact: the model, not the exact value, is the bar


def test_a_pair_off_the_compression_model_is_not_explained_as_rounding() -> None:
    """The pair line said "explained by rounding ..." whatever the two were: a JAX model
    scaled by 1.001 failed the run and was still explained away as the hook's rounding."""
    from xgrad.crosscheck.compare_backends import _wire_pair
    from xgrad.crosscheck.run import BackendReport

    g = np.linspace(-1.0, 1.0, 16, dtype=np.float32)
    one = BackendReport("a", "", "ok", grads={"w": g})
    other = BackendReport("b", "", "fail", grads={"w": g * np.float32(1.001)})
    args = (one, other, ["w"], "float16", np.dtype(np.float16), "float32")
    assert "explained by rounding" in _wire_pair(*args, True)
    off = _wire_pair(*args, False)
    assert "explained by rounding" not in off
    assert "not the compression's rounding; the gradients themselves differ" in off


def test_ulp_distance_of_opposite_signs_does_not_wrap() -> None:
    """float64 values of opposite signs can be more than 2**63 steps apart: the int64
    difference wrapped, and 1e300 against -1e300 printed as a modest count."""
    huge = crosscheck.ulp_distance(np.array([1e300]), np.array([-1e300]))
    assert huge > 2**62
    assert crosscheck.ulp_distance(np.array([3.0]), np.array([-3.0])) > 2**62
    assert crosscheck.ulp_distance(np.array([-0.0]), np.array([0.0])) == 0


def test_the_near_zero_marker_is_for_passing_rows_and_scales_with_the_dtype() -> None:
    """A failing row's large count was starred as harmless too, and a fixed 2**16 could
    never star a 16-bit dtype (its whole range is fewer steps)."""
    from xgrad.crosscheck.report import _ulp_cell, near_zero_limit

    limit32 = near_zero_limit("float32", 1e-6)
    assert 8 < limit32 < 9  # 1e-6 / 2**-23
    assert _ulp_cell(1000, True, limit32).endswith("*")
    assert not _ulp_cell(1000, False, limit32).endswith("*")  # beyond tolerance: no excuse
    assert not _ulp_cell(5, True, limit32).endswith("*")
    limit_bf16 = near_zero_limit("bfloat16", 5e-2)
    assert _ulp_cell(28863, True, limit_bf16).endswith("*")


def test_a_hook_whose_wire_dtype_is_the_models_attributes_nothing_to_rounding() -> None:
    """bfloat16 gradients through the bf16 hook: the wire rounds nothing, yet pairs were
    "explained by rounding per-rank bfloat16 gradients ... to bfloat16"."""
    pytest.importorskip("jax")
    pytest.importorskip("ml_dtypes")
    report = crosscheck.run_crosscheck(
        Case(steps=1, dtype="bfloat16", hook="bf16"), backends=["reference", "jax-shard_map"]
    )
    assert len(report.attribution) == 1, report.attribution
    assert "already are bfloat16, so the wire rounds nothing" in report.attribution[0]


def test_runs_that_differ_in_a_setting_write_files_of_their_own(tmp_path: Path) -> None:
    """The stem named model, world size, dtype, cap and hook only: runs that differed in
    seed, batch, JAX processes, stateful PowerSGD or device overwrote one another's files."""
    stems = set()
    for case in (Case(steps=1), Case(steps=1, seed=3), Case(steps=1, batch_per_rank=2)):
        report = crosscheck.run_crosscheck(case, backends=["reference"])
        json_path, _ = crosscheck.write_outputs(report, tmp_path)
        stems.add(json_path.stem)
    assert stems == {
        "crosscheck-mlp-ws2-float32-cap2048-nohook",
        "crosscheck-mlp-ws2-float32-cap2048-nohook-seed3",
        "crosscheck-mlp-ws2-float32-cap2048-nohook-b2",
    }


def test_the_summary_row_of_a_backend_that_did_not_run_says_why() -> None:
    """Its row in the summary was blank after the status."""
    pytest.importorskip("xgrad.torch_backend.crosscheck")
    report = crosscheck.run_crosscheck(
        Case(steps=1, hook="bf16"), backends=["reference", "torch-ddp"]
    )  # PyTorch's bf16 hook needs CUDA: skipped on the CPU, before anything runs
    skipped = next(b for b in report.backends if b.name == "torch-ddp")
    assert skipped.status == "skipped" and skipped.reason
    summary = crosscheck.format_report(report).split("\nsummary\n")[1]
    row = next(line for line in summary.splitlines() if line.split()[:1] == ["torch-ddp"])
    assert row.split()[1] == "skipped" and skipped.reason[:20] in row, row
