"""How far a gradient is from its reference: max abs, rel and ULPs."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from xgrad.buckets import BucketPlan


@dataclass(frozen=True)
class Metrics:
    """Differences of one parameter (or bucket) against the reference."""

    name: str
    max_abs: float
    rel: float
    ulp: int
    ulp_at_max: float
    passed: bool


def bit_identical(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two gradients are the same bits: the same dtype and shape and every byte
    equal (``np.array_equal`` would call ``-0.0`` and ``0.0``, or a float32 and a float64
    array of equal values, the same)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def ordered_bits(a: np.ndarray) -> np.ndarray:
    """Map floats to int64 so that adjacent floats of ``a``'s dtype differ by exactly one."""
    mag, negative = _magnitude_bits(a)
    signed = mag.astype(np.int64)
    return np.where(negative, -signed, signed)


def _magnitude_bits(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(|a| as its ordered bits, uint64; whether the sign bit is set)``."""
    bits = a.dtype.itemsize * 8
    unsigned = {16: np.uint16, 32: np.uint32, 64: np.uint64}[bits]
    raw = np.ascontiguousarray(a).view(unsigned)
    mag = (raw & unsigned((1 << (bits - 1)) - 1)).astype(np.uint64)
    return mag, (raw >> unsigned(bits - 1)).astype(bool)


def _steps_apart(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per element, how many of the dtype's steps lie between ``a`` and ``b`` (uint64: two
    float64 values of opposite signs can be more than 2**63 steps apart, which wrapped
    around in int64 and printed 3.0 against -3.0 as a small count)."""
    ma, na = _magnitude_bits(a)
    mb, nb = _magnitude_bits(b)
    same = na == nb
    return np.where(same, np.maximum(ma, mb) - np.minimum(ma, mb), ma + mb)


def ulp_distance(a: np.ndarray, ref: np.ndarray) -> int:
    """Largest distance in ULPs of ``a``'s dtype between ``a`` and ``ref`` rounded to it.

    NaNs or infinities anywhere give ``sys.maxsize``.
    """
    if a.size == 0:
        return 0
    rounded = np.asarray(ref, dtype=np.float64).astype(a.dtype)
    if not (np.all(np.isfinite(a.astype(np.float64))) and np.all(np.isfinite(ref))):
        return sys.maxsize
    return min(int(_steps_apart(a, rounded).max()), sys.maxsize - 1)  # maxsize: not finite


def wire_ulps(got: np.ndarray, ref: np.ndarray, wire: np.dtype) -> float:
    """``max |got - ref|`` in ULPs of ``wire`` at ``ref``'s largest magnitude (its scale)."""
    diff = float(np.abs(got.astype(np.float64) - ref.astype(np.float64)).max(initial=0.0))
    scale = float(np.abs(ref.astype(np.float64)).max(initial=0.0))
    spacing = float(np.spacing(np.asarray(scale, dtype=np.float64).astype(wire)).astype(np.float64))
    return diff / spacing if spacing > 0 else (0.0 if diff == 0 else math.inf)


def compare(name: str, got: np.ndarray, ref: np.ndarray, tol: float) -> Metrics:
    """Metrics of ``got`` against ``ref`` (see the module docstring), with pass/fail at ``tol``."""
    if got.shape != ref.shape:
        raise ValueError(f"gradient of {name!r} has shape {got.shape}, expected {ref.shape}")
    g = np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    diff = np.abs(g - r)
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(r).max()) if r.size else 0.0
    rel = max_abs / scale if scale > 0 else max_abs
    if not math.isfinite(rel):
        rel = math.inf
    spacing = float(np.spacing(np.abs(np.asarray(scale, dtype=got.dtype))))
    at_max = max_abs / spacing if spacing > 0 else math.inf
    return Metrics(name, max_abs, rel, ulp_distance(got, r), at_max, rel <= tol)


def compare_buckets(
    names: Sequence[str],
    got: Mapping[str, np.ndarray],
    ref: Mapping[str, np.ndarray],
    plan: BucketPlan,
    tol: float,
) -> list[Metrics]:
    """Per-bucket metrics: each bucket's parameters raveled and compared as one array."""
    out = []
    for b, bucket in enumerate(plan.buckets):
        members = [names[i] for i in bucket]
        label = f"bucket {b} [{','.join(str(i) for i in bucket)}]"
        g = np.concatenate([np.ravel(got[n]) for n in members])
        r = np.concatenate([np.ravel(ref[n]).astype(np.float64) for n in members])
        out.append(compare(label, g, r, tol))
    return out


def format_ulp(ulp: int) -> str:
    """An ULP count for tables: ``inf`` for the NaN/infinity marker of :func:`ulp_distance`."""
    return "inf" if ulp >= sys.maxsize else str(ulp)
