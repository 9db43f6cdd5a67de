"""Running a case on the runners and comparing every result with what it is measured against."""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np

from xgrad.buckets import BucketPlan
from xgrad.crosscheck.case import Case, Inputs, make_inputs, tolerance
from xgrad.crosscheck.compare_backends import agreement, attribution
from xgrad.crosscheck.metrics import (
    Metrics,
    compare,
    compare_buckets,
)
from xgrad.crosscheck.runners import Entry, check_world_size, runner_entries, step_of
from xgrad.crosscheck.truth import (
    per_rank_grads,
    powersgd_config,
    powersgd_run,
    reference_grads,
    torch_sampler,
)
from xgrad.progress import Progress


@dataclass
class BackendReport:
    """One runner's outcome: ``status`` is ``ok``, ``fail``, ``error``, ``timeout`` or ``skipped``.

    ``timeout``: the run took longer than the case's ``timeout`` (its answer, if any, is
    not measured); ``reason`` names the runner, the limit and the time it took.
    """

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
        return _over_time(report, inputs.case.timeout)
    report.wall_seconds = time.perf_counter() - start
    if _over_time(report, inputs.case.timeout).status == "timeout":
        return report
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


def _over_time(report: BackendReport, limit: float) -> BackendReport:
    """``report`` marked ``timeout`` when its run took longer than ``limit`` seconds.

    A runner in this process (JAX's, the reference's) cannot be stopped part way: it is
    run to its end, which leaves no half-done state behind for the runners after it, and
    then judged by the time it took. One that spawns processes (torch's) stops them at
    the limit and raises; both end up here the same way. A run past the limit is not
    measured, so ``--timeout`` bounds every runner alike.
    """
    if report.wall_seconds <= limit:
        return report
    why = f": {report.reason}" if report.reason else ""
    report.status = "timeout"
    report.reason = (
        f"{report.name} took {report.wall_seconds:.3g} s, over the timeout of {limit:g} s{why}"
    )
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
        WorldSizeError: a chosen runner cannot run ``case.world_size`` ranks.
    """
    chosen = runner_entries(backends)
    check_world_size(chosen, case.world_size)
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
        attribution(inputs, reports, exact, ref),
        lines,
    )
