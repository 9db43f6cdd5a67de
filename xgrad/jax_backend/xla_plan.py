"""The bucket plan XLA chose: which gradients each all-reduce of a compiled step carries.

Under ``jax.jit`` with a ``NamedSharding`` GSPMD inserts the gradient reductions and XLA's
all-reduce combiner merges them into a few collectives. Reading the compiled HLO shows
which: each ``all-reduce`` is a tuple of operands, whose shapes are matched to the
parameters' (first unmatched parameter of that shape and dtype, in plan order). So the
crosscheck can report the plan XLA really ran, as it does for every other runner.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from xgrad.buckets import BucketPlan

_ALL_REDUCE = re.compile(r"=\s*\(?(.*?)\)?\s+all-reduce(?:-start)?\(")
_SHAPE = re.compile(r"(bf16|f16|f32|f64)\[([\d,]*)\]")
_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64"}


def all_reduce_operands(hlo: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Per all-reduce of ``hlo`` (in program order): its operands' (dtype, shape)."""
    out = []
    for line in hlo.splitlines():
        match = _ALL_REDUCE.search(line)
        if match is None:
            continue
        out.append(
            [
                (_DTYPES[kind], tuple(int(d) for d in dims.split(",") if d))
                for kind, dims in _SHAPE.findall(match.group(1))
            ]
        )
    return out


def xla_plan(hlo: str, params: Sequence[Any]) -> BucketPlan | None:
    """The plan whose bucket ``b`` is the parameters the ``b``-th all-reduce carries.

    Args:
        hlo: the compiled module's text (``jitted.lower(...).compile().as_text()``).
        params: the gradients' arrays (or shapes with dtypes) in plan index order.

    Returns:
        The plan, or None when some parameter's gradient is not found in an all-reduce
        (XLA reduced it otherwise, e.g. as a reduce-scatter).
    """
    wanted = [(np.dtype(p.dtype).name, tuple(p.shape)) for p in params]
    free = list(range(len(wanted)))
    buckets: list[tuple[int, ...]] = []
    for operands in all_reduce_operands(hlo):
        bucket = []
        for operand in operands:
            k = next((i for i in free if wanted[i] == operand), None)
            if k is not None:
                free.remove(k)
                bucket.append(k)
        if bucket:
            buckets.append(tuple(bucket))
    if free:
        return None
    sizes = [int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize for p in params]
    return BucketPlan(tuple(buckets), tuple(sum(sizes[i] for i in b) for b in buckets))
