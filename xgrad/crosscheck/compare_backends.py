"""Why a crosscheck's backends differ: how much of it a lossy hook's compression explains,
and how the backends compare with one another (bit-identical groups, the largest
differences, different bucket plans). Apart from :mod:`.run`, which runs the case."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from xgrad import models as zoo
from xgrad.buckets import BucketPlan
from xgrad.crosscheck.case import WIRE_DTYPES, Inputs, tolerance
from xgrad.crosscheck.metrics import (
    bit_identical,
    compare,
    format_ulp,
    ulp_distance,
    wire_ulps,
)
from xgrad.crosscheck.truth import POWERSGD_RANK, compression_model, per_rank_grads

if TYPE_CHECKING:
    from xgrad.crosscheck.run import BackendReport

__all__ = ["agreement", "attribution"]


def attribution(
    inputs: Inputs,
    backends: Sequence[BackendReport],
    ref: Mapping[str, np.ndarray],
    measure: Mapping[str, np.ndarray],
) -> list[str]:
    """With a compression hook: how much of each difference the compression explains."""
    case = inputs.case
    hook = case.hook
    names = list(inputs.weights)
    if not any(b.grads for b in backends):
        # Nothing ran (every backend skipped or failed): no difference to explain.
        return []
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
