"""Running a case on the runners and comparing every result with what it is measured against."""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np

from xgrad import models as zoo
from xgrad.buckets import BucketPlan
from xgrad.crosscheck.case import WIRE_DTYPES, Case, Inputs, make_inputs, tolerance
from xgrad.crosscheck.metrics import (
    Metrics,
    bit_identical,
    compare,
    compare_buckets,
    format_ulp,
    ulp_distance,
    wire_ulps,
)
from xgrad.crosscheck.runners import Entry, runner_entries, step_of
from xgrad.crosscheck.truth import (
    POWERSGD_RANK,
    compression_model,
    per_rank_grads,
    powersgd_config,
    powersgd_run,
    reference_grads,
    torch_sampler,
)
from xgrad.progress import Progress


@dataclass
class BackendReport:
    """One runner's outcome: ``status`` is ``ok``, ``fail``, ``error`` or ``skipped``."""

    name: str
    description: str
    status: str
    reason: str = ""
    backend: str = ""
    seconds_per_step: float | None = None
    wall_seconds: float = 0.0
    plan: BucketPlan | None = None
    params: list[Metrics] = field(default_factory=list)
    buckets: list[Metrics] = field(default_factory=list)
    grads: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def worst(self) -> Metrics | None:
        """The parameter with the largest ``rel``."""
        return max(self.params, key=lambda m: m.rel) if self.params else None


@dataclass
class Report:
    """Everything a crosscheck found; ``ok`` is the exit status's source.

    ``truth`` says what the backends were measured against (the float64 gradient, or the
    PowerSGD model); the word "reference" is kept for the reference backend.
    """

    case: Case
    tolerance: float
    plan: BucketPlan
    truth: str
    backends: list[BackendReport]
    attribution: list[str]
    agreement: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No backend failed or raised (skipped ones do not count)."""
        return all(b.status in ("ok", "skipped") for b in self.backends)

    @property
    def nothing_ran(self) -> bool:
        """Every backend was skipped: nothing was compared (no pass to report)."""
        return all(b.status == "skipped" for b in self.backends)


def _run_one(
    entry: Entry,
    inputs: Inputs,
    measure: Callable[[BucketPlan | None], Mapping[str, np.ndarray]],
    tol: float,
) -> BackendReport:
    runner = entry.runner
    description = f"backend {entry.backend}" if runner is None else runner.description
    report = BackendReport(entry.name, description, "skipped", backend=entry.backend)
    step = step_of(inputs)
    start = time.perf_counter()
    try:
        reason = entry.unavailable or (runner.unsupported(step) if runner is not None else None)
        if reason or runner is None:
            report.reason = reason or ""
            return report
        result = runner.run(step)
    except Exception as err:  # a backend's failure is a finding, reported with the others
        report.status = "error"
        report.reason = f"{type(err).__name__}: {err}"
        report.wall_seconds = time.perf_counter() - start
        return report
    report.wall_seconds = time.perf_counter() - start
    problem = _malformed(result, inputs.weights)
    if problem:
        report.status = "error"
        report.reason = problem
        return report
    report.seconds_per_step = result.seconds_per_step
    report.plan = result.plan
    names = list(inputs.weights)
    report.grads = {n: result.grads[n] for n in names}
    ref = measure(result.plan)
    report.params = [compare(n, report.grads[n], ref[n], tol) for n in names]
    # Per bucket of the plan it really ran (PyTorch's DDP makes its own from the same cap).
    ran = inputs.plan if result.plan is None else result.plan
    report.buckets = compare_buckets(names, report.grads, ref, ran, tol)
    report.status = "ok" if all(m.passed for m in report.params) else "fail"
    if report.status == "fail":
        worst = report.worst
        assert worst is not None
        report.reason = f"{worst.name}: rel {worst.rel:.3g} > tolerance {tol:.3g}"
    return report


def _malformed(result: object, weights: Mapping[str, np.ndarray]) -> str:
    """Why a runner's answer cannot be measured ("" when it can): not a StepResult, a
    gradient missing, not an array, or of another shape or dtype than its parameter; a
    step time that is not a positive finite number of seconds (or None: not measured).

    A plug-in's broken answer is then its own error in the report, next to the others',
    instead of an exception that ends the whole crosscheck; and a gradient in a wider
    dtype than the model's (float64 for a float32 case) is refused, not judged as if
    the backend had computed in float32.
    """
    grads = getattr(result, "grads", None)
    if not isinstance(grads, Mapping):
        return f"run() returned {type(result).__name__}, not a StepResult with a grads dict"
    missing = [n for n in weights if n not in grads]
    if missing:
        return f"no gradient returned for {missing}"
    for n, w in weights.items():
        g = grads[n]
        if not isinstance(g, np.ndarray):
            return f"gradient of {n!r} is a {type(g).__name__}, not a numpy array"
        if g.shape != w.shape or g.dtype != w.dtype:
            return (
                f"gradient of {n!r} is {g.dtype}{list(g.shape)}, "
                f"its parameter {w.dtype}{list(w.shape)}"
            )
    seconds = getattr(result, "seconds_per_step", None)
    if seconds is not None and not (
        isinstance(seconds, numbers.Real) and math.isfinite(seconds) and float(seconds) >= 0
    ):
        return f"seconds_per_step={seconds!r} is not a finite number of seconds >= 0"
    return ""


def _attribution(
    inputs: Inputs,
    backends: Sequence[BackendReport],
    ref: Mapping[str, np.ndarray],
    measure: Mapping[str, np.ndarray],
) -> list[str]:
    """With a compression hook: how much of each difference the compression explains."""
    case = inputs.case
    hook = case.hook
    names = list(inputs.weights)
    if hook == "powersgd":
        lossy = max(compare(n, measure[n], ref[n], math.inf).rel for n in names)
        return [
            f"hook powersgd (rank {POWERSGD_RANK}): backends are measured against the PowerSGD "
            f"model, which itself is off by rel {lossy:.3g} from the exact float64 gradient "
            "(a low-rank approximation, lossy by design); tolerance "
            f"{tolerance(case.dtype, hook):.3g}."
        ]
    if hook not in WIRE_DTYPES:
        return []
    wire = WIRE_DTYPES[hook]
    if zoo.as_dtype(wire) == zoo.as_dtype(case.dtype):
        # Nothing to attribute: the gradients already are what the wire carries.
        return [
            f"hook {hook}: the gradients already are {wire}, so the wire rounds nothing; "
            f"differences are the reductions' own {wire} arithmetic (tolerance "
            f"{tolerance(case.dtype, hook):.3g}, {case.dtype}'s)."
        ]
    lines = [
        f"hook {hook}: gradients cross the wire in {wire}; tolerance "
        f"{tolerance(case.dtype, hook):.3g} (wire) instead of {tolerance(case.dtype):.3g} "
        f"({case.dtype} alone)."
    ]
    model = compression_model(per_rank_grads(inputs), hook, case.dtype)
    wire_dtype = zoo.as_dtype(wire)
    exact = max(compare(n, model[n], ref[n], math.inf).rel for n in names)
    lines.append(
        f"the compression alone (exact per-rank gradients, {hook}-reduced in numpy) is off "
        f"by rel {exact:.3g} from the float64 reference."
    )
    ran = [b for b in backends if b.grads]
    near: dict[str, bool] = {}  # within the hook's tolerance of the compression model
    for b in ran:
        ulps = max(wire_ulps(b.grads[n], model[n], wire_dtype) for n in names)
        rel = max(compare(n, b.grads[n], model[n], math.inf).rel for n in names)
        near[b.name] = rel <= tolerance(case.dtype, hook)
        lines.append(
            f"{b.name}: equal to the compression model, bit for bit"
            if ulps == 0
            else f"{b.name}: within {ulps:.3g} {wire} ULPs (rel {rel:.3g}) of the compression model"
        )
    # Between backends (the first runner of each that ran; runners of one backend share
    # its arithmetic): how much of their difference the compression explains.
    firsts: dict[str, BackendReport] = {}
    for b in ran:
        firsts.setdefault(b.backend or b.name, b)
    sides = list(firsts.values())
    for i, one in enumerate(sides):
        for other in sides[i + 1 :]:
            if all(bit_identical(one.grads[n], other.grads[n]) for n in names):
                continue
            explained = near[one.name] and near[other.name]
            lines.append(_wire_pair(one, other, names, wire, wire_dtype, case.dtype, explained))
    return lines


def _wire_pair(
    one: BackendReport,
    other: BackendReport,
    names: Sequence[str],
    wire: str,
    wire_dtype: np.dtype,
    dtype: str,
    explained: bool,
) -> str:
    """How far two backends' gradients are apart on the wire's scale, and whether the
    compression explains it (``explained``: each is within the hook's tolerance of the
    compression model; else one is off it, and it cannot be rounding alone)."""
    ulps = max(wire_ulps(one.grads[n], other.grads[n], wire_dtype) for n in names)
    rel = max(compare(n, one.grads[n], other.grads[n], math.inf).rel for n in names)
    steps = max(
        ulp_distance(
            one.grads[n].astype(np.float64).astype(wire_dtype),
            other.grads[n].astype(np.float64),
        )
        for n in names
    )
    head = (
        f"{one.name} vs {other.name}: differ by up to {ulps:.3g} {wire} ULPs at "
        f"the parameters' scale (rel {rel:.3g}; {format_ulp(steps)} {wire} steps element by "
        "element, which elements near zero inflate), "
    )
    if not explained:
        return head + (
            "and not both are within the tolerance of the compression model (above): the "
            "difference is not the compression's rounding; the gradients themselves differ."
        )
    return head + (
        "while each is within the ULPs above of the compression model: "
        f"the difference is explained by rounding per-rank {dtype} gradients that "
        f"differ in their last bits to {wire}, not by either reduction."
    )


def _brief(plan: BucketPlan, width: int = 48) -> str:
    """A plan's buckets in launch order, shortened: ``[5,4,3] [2,1,0]``."""
    text = " ".join("[" + ",".join(map(str, b)) + "]" for b in plan.buckets)
    return text if len(text) <= width else text[: width - 3] + "..."


def agreement(
    backends: Sequence[BackendReport], names: Sequence[str], hook: str | None = None
) -> list[str]:
    """Which backends agree bit for bit, how far apart the groups that do not are, and
    whether they ran different plans (which, with PowerSGD, explains the difference)."""
    groups: list[list[BackendReport]] = []
    for b in (b for b in backends if b.grads):
        for group in groups:
            if all(bit_identical(b.grads[n], group[0].grads[n]) for n in names):
                group.append(b)
                break
        else:
            groups.append([b])
    lines = [
        "bit-identical: " + " = ".join(b.name for b in group) for group in groups if len(group) > 1
    ]
    for i, first in enumerate(groups):
        for second in groups[i + 1 :]:
            a, b = first[0], second[0]
            metrics = [compare(n, a.grads[n], b.grads[n], math.inf) for n in names]
            worst = max(metrics, key=lambda m: m.rel)
            line = (
                f"{a.name} vs {b.name}: max rel {worst.rel:.3g} ({worst.name}), "
                f"max ulp@max {max(m.ulp_at_max for m in metrics):.3g}"
            )
            if a.plan is not None and b.plan is not None and a.plan != b.plan:
                line += (
                    f"; they ran different bucket plans ({_brief(a.plan)} and {_brief(b.plan)})"
                    + (
                        ", and PowerSGD's result depends on the buckets (its random draws and "
                        "which gradients share a matrix): each is measured against the "
                        "PowerSGD model of its own plan"
                        if hook == "powersgd"
                        else ""
                    )
                )
            lines.append(line)
    return lines


def _measure(
    inputs: Inputs, exact: Mapping[str, np.ndarray]
) -> Callable[[BucketPlan | None], Mapping[str, np.ndarray]]:
    """What a backend that ran with a given plan is measured against.

    The exact gradient, except under PowerSGD, whose result depends on the buckets (their
    random draws and the order of their gradients): then the PowerSGD model for that plan.
    """
    case = inputs.case
    if case.hook != "powersgd":
        return lambda plan: exact
    rank_grads = per_rank_grads(inputs)
    cache: dict[str, dict[str, np.ndarray]] = {}

    def model(plan: BucketPlan | None) -> Mapping[str, np.ndarray]:
        plan = inputs.plan if plan is None else plan
        key = plan.digest()
        if key not in cache:
            # One untimed warm-up step and case.steps timed ones, as every runner runs.
            cache[key] = powersgd_run(
                rank_grads,
                inputs.weights,
                plan,
                powersgd_config(case.stateful),
                case.steps + 1,
                case.dtype,
                torch_sampler(),
            )
        return cache[key]

    return model


def run_crosscheck(
    case: Case,
    *,
    backends: Sequence[str] | None = None,
    progress: TextIO | None = None,
) -> Report:
    """Run ``case`` on every runner (or those named in ``backends``) and compare.

    Args:
        case: the configuration.
        backends: names of registered backends (all their runners) or of runners;
            default every runner of every registered backend.
        progress: where to write one line per backend as it starts and ends (e.g. stderr),
            under a progress bar when it is a terminal.

    Raises:
        ValueError: an unknown backend name (the message lists the known ones).
    """
    chosen = runner_entries(backends)
    inputs = make_inputs(case)
    tol = tolerance(case.dtype, case.hook)

    total = len(chosen) + 1
    with Progress(total, "crosscheck", progress) as bar:
        bar.say(f"[1/{total}] float64 truth (one process, full batch) ...")
        start = time.perf_counter()
        exact, how = reference_grads(inputs)
        measure = _measure(inputs, exact)
        ref = measure(inputs.plan)
        if case.hook == "powersgd":
            how = (
                "PowerSGD model: torch's powerSGD_hook (rank 1) in float64 on exact per-rank "
                "gradients, from torch's own random draws, for the plan each backend ran"
                + (
                    f", {case.steps + 1} steps with error feedback and warm start"
                    if case.stateful
                    else ""
                )
            )
        bar.say(f"[1/{total}] truth done ({time.perf_counter() - start:.1f} s): {how}")
        reports = []
        for k, entry in enumerate(chosen, start=2):
            name = entry.name
            bar.advance(name)
            runner = entry.runner
            about = f"backend {entry.backend}" if runner is None else runner.description
            bar.say(f"[{k}/{total}] {name}: {about} ...")
            report = _run_one(entry, inputs, measure, tol)
            extra = f": {report.reason}" if report.reason else ""
            bar.say(f"[{k}/{total}] {name} {report.status} ({report.wall_seconds:.1f} s){extra}")
            reports.append(report)
    names = list(inputs.weights)
    lines = agreement(reports, names, case.hook)
    if case.device != "cpu":
        from xgrad.crosscheck.devices import cuda_vs_cpu

        lines += cuda_vs_cpu(chosen, reports, step_of(inputs))
    return Report(
        case,
        tol,
        inputs.plan,
        how,
        reports,
        _attribution(inputs, reports, exact, ref),
        lines,
    )
