"""The outputs of a crosscheck: the printed tables, JSON and CSV."""

from __future__ import annotations

import csv
import json
import math
import re
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from xgrad import models as zoo
from xgrad.crosscheck.case import Case
from xgrad.crosscheck.metrics import format_ulp
from xgrad.crosscheck.run import Report


def near_zero_limit(dtype: str, tol: float) -> float:
    """The element-by-element ULP count past which a row *within* tolerance is marked:
    the tolerance in ULPs of ``dtype`` at a parameter's scale (``tol / eps``). A passing row
    can count more only where elements nearly cancel to 0 (the marker's footnote). A fixed
    2**16 marked real failures as harmless too, and could never mark a 16-bit dtype, whose
    whole range is fewer steps than that."""
    eps = float(np.spacing(np.ones((), dtype=zoo.as_dtype(dtype))).astype(np.float64))
    return tol / eps  # the spacing at 1, as metrics' ULP scales are read


def _ulp_cell(ulp: int, passed: bool, limit: float) -> str:
    return format_ulp(ulp) + ("*" if passed and limit < ulp < sys.maxsize else "")


def format_report(report: Report, *, per_bucket: bool = True) -> str:
    """The tables: per backend, per parameter (and per bucket), then a summary."""
    case = report.case
    names = zoo.param_names(case.model)
    lines = [
        f"xgrad crosscheck: model {case.model} ({zoo.get_spec(case.model).description}), "
        f"world size {case.world_size}, {case.dtype}, bucket cap {case.bucket_cap_bytes} B, "
        f"hook {case.hook or 'none'}, batch {case.world_size}x{case.batch_per_rank}, "
        f"seed {case.seed}",
        f"truth: {report.truth}; rel = max|g-truth| / max|truth| per parameter; "
        f"tolerance rel <= {report.tolerance:.3g}",
        "plan (launch order): "
        + "; ".join(
            f"{b}: " + ",".join(names[i] for i in bucket)
            for b, bucket in enumerate(report.plan.buckets)
        ),
        "",
    ]
    limit = near_zero_limit(case.dtype, report.tolerance)
    for b in report.backends:
        width = max(len(n) for n in (*names, *(m.name for m in (*b.params, *b.buckets))))
        if b.status == "skipped":
            lines.append(f"{b.name}: skipped ({b.reason})")
            lines.append("")
            continue
        if b.status in ("error", "timeout"):
            lines.append(f"{b.name}: {b.status.upper()} {b.reason}")
            lines.append("")
            continue
        step = f"{b.seconds_per_step * 1e3:.2f} ms/step" if b.seconds_per_step is not None else ""
        if b.plan is None:
            plan = "plan not reported"
        elif b.plan == report.plan:
            plan = "shared plan"
        else:
            own = "; ".join(
                f"{k}: " + ",".join(names[i] for i in bucket)
                for k, bucket in enumerate(b.plan.buckets)
            )
            plan = f"its own plan ({own}); bucket rows are its own"
        lines.append(f"{b.name}: {b.status.upper()}  {step}  {plan}  ({b.description})")
        lines.append(f"  {'':<{width}}  {'max abs':>10}  {'rel':>10}  {'ulp':>10}  {'ulp@max':>8}")
        rows = list(b.params) + (list(b.buckets) if per_bucket else [])
        for m in rows:
            flag = "" if m.passed else "  <-- beyond tolerance"
            lines.append(
                f"  {m.name:<{width}}  {m.max_abs:>10.3g}  {m.rel:>10.3g}  "
                f"{_ulp_cell(m.ulp, m.passed, limit):>10}  {m.ulp_at_max:>8.3g}{flag}"
            )
        lines.append("")
    lines.append("summary")
    lines.append(
        f"  {'backend':<14} {'status':<8} {'max abs':>10} {'max rel':>10} {'ulp':>10} "
        f"{'ulp@max':>8} {'ms/step':>9}"
    )
    for b in report.backends:
        worst = b.worst
        if worst is None:  # skipped or failed: why, shortened (in full above)
            why = b.reason if len(b.reason) <= 60 else b.reason[:57] + "..."
            lines.append(f"  {b.name:<14} {b.status:<8} {why}".rstrip())
            continue
        max_abs = max(m.max_abs for m in b.params)
        ulp = max(m.ulp for m in b.params)
        at_max = max(m.ulp_at_max for m in b.params)
        ms = f"{b.seconds_per_step * 1e3:.2f}" if b.seconds_per_step is not None else "-"
        lines.append(
            f"  {b.name:<14} {b.status:<8} {max_abs:>10.3g} {worst.rel:>10.3g} "
            f"{_ulp_cell(ulp, all(m.passed for m in b.params), limit):>10} {at_max:>8.3g} "
            f"{ms:>9}"
        )
    rows = [m for b in report.backends for m in (*b.params, *b.buckets)]
    if any(m.passed and limit < m.ulp < sys.maxsize for m in rows):
        note = (
            f"* within tolerance, yet more {case.dtype} steps off element by element than "
            f"the tolerance allows at a parameter's scale ({limit:.3g}): an element whose "
            "exact gradient (nearly) cancels to 0, where the dtype's numbers are dense, is "
            "many steps off while harmless; ulp@max, the error in ULPs at the parameter's "
            "largest magnitude, is what the tolerance means"
        )
        lines += textwrap.wrap(note, 88, initial_indent="  ", subsequent_indent="    ")
    if any(b.seconds_per_step is not None for b in report.backends):
        # A few steps of a small model, a millisecond or so each: the runs differ by
        # several times from one launch to the next on a busy machine (the order of two
        # DDPs flipped in three runs of the same command), so the column orients, no more.
        rebuilt = "; a DDP's all but its first, which rebuilds its buckets"
        note = (
            f"ms/step: mean wall time of the timed steps ({case.steps}"
            f"{rebuilt if case.steps > 1 else ''}), one run each, for orientation: "
            "`xgrad bench ddp` compares speeds"
        )
        lines += textwrap.wrap(note, 88, initial_indent="  ", subsequent_indent="    ")
    if report.agreement:
        lines.append("")
        lines.append("between backends")
        lines.extend(f"  {line}" for line in report.agreement)
    if report.attribution:
        lines.append("")
        lines.append("attribution")
        lines.extend(f"  {line}" for line in report.attribution)
    lines.append("")
    if not report.ok:
        lines.append("FAIL")
    elif report.nothing_ran:
        # Nothing was compared: a PASS here would vouch for numbers no backend gave.
        lines.append("NOTHING RAN: every backend was skipped (see why above)")
    else:
        lines.append("PASS: every backend that ran is within tolerance")
    return "\n".join(lines)


def report_to_dict(report: Report) -> dict[str, Any]:
    """A JSON-ready form of the report (gradients left out)."""
    return {
        "case": asdict(report.case),
        "tolerance": report.tolerance,
        "truth": report.truth,
        "plan": report.plan.to_dict(),
        "plan_digest": report.plan.digest(),
        "param_names": list(zoo.param_names(report.case.model)),
        "ok": report.ok,
        "attribution": report.attribution,
        "agreement": report.agreement,
        "backends": [
            {
                "name": b.name,
                "description": b.description,
                "status": b.status,
                "reason": b.reason,
                "seconds_per_step": b.seconds_per_step,
                "wall_seconds": b.wall_seconds,
                "plan": None if b.plan is None else b.plan.to_dict(),
                "params": [asdict(m) for m in b.params],
                "buckets": [asdict(m) for m in b.buckets],
            }
            for b in report.backends
        ],
    }


def write_outputs(report: Report, out_dir: Path) -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.csv`` under ``out_dir``; return their paths.

    The stem names the case; a pair's ``module:attribute`` becomes ``module_attribute``.
    Settings other than their defaults that change the numbers are named too (seed, batch
    per rank, JAX processes, stateful PowerSGD, device): runs that differed only in them
    wrote the same files, the last one's over the others'.
    """
    case = report.case
    model = re.sub(r"[^A-Za-z0-9_.-]", "_", case.model)
    stem = (
        f"crosscheck-{model}-ws{case.world_size}-{case.dtype}-"
        f"cap{case.bucket_cap_bytes}-{case.hook or 'nohook'}"
    )
    defaults = Case()
    for value, default, tag in (
        (case.seed, defaults.seed, f"seed{case.seed}"),
        (case.batch_per_rank, defaults.batch_per_rank, f"b{case.batch_per_rank}"),
        (case.jax_processes, defaults.jax_processes, f"jp{case.jax_processes}"),
        (case.stateful, defaults.stateful, "stateful"),
        (case.device, defaults.device, case.device),
    ):
        if value != default:
            stem += f"-{tag}"
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    csv_path = out_dir / f"{stem}.csv"
    json_path.write_text(json.dumps(_finite(report_to_dict(report)), indent=2))
    with csv_path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(
            [
                "backend",
                "status",
                "kind",
                "name",
                "max_abs",
                "rel",
                "ulp",
                "ulp_at_max",
                "passed",
                "ms_per_step",
            ]
        )
        for b in report.backends:
            ms = "" if b.seconds_per_step is None else f"{b.seconds_per_step * 1e3:.4f}"
            if not b.params:
                writer.writerow([b.name, b.status, "", "", "", "", "", "", "", ms])
            for kind, rows in (("param", b.params), ("bucket", b.buckets)):
                for m in rows:
                    writer.writerow(
                        [
                            b.name,
                            b.status,
                            kind,
                            m.name,
                            repr(m.max_abs),
                            repr(m.rel),
                            m.ulp,
                            repr(m.ulp_at_max),
                            int(m.passed),
                            ms,
                        ]
                    )
    return json_path, csv_path


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as strings (``"inf"``), which strict JSON cannot hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
