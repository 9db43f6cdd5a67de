"""Torch's PowerSGD random draws, replayed so other backends start from the same ``Q``."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from xgrad.buckets import BucketPlan
from xgrad.crosscheck.truth import POWERSGD_MIN_RATE, POWERSGD_RANK, bucket_matrices
from xgrad.torch_backend.models import torch_dtype

__all__ = ["POWERSGD_MIN_RATE", "POWERSGD_RANK", "initial_qs"]


def initial_qs(
    weights: Mapping[str, np.ndarray], plan: BucketPlan, steps: int, seed: int = 0
) -> dict[int, list[np.ndarray]]:
    """The initial ``Q`` torch's ``powerSGD_hook`` draws at its ``steps``-th PowerSGD step.

    Torch seeds its generator once per bucket and step from ``RandomState(seed)`` and draws
    one ``(1, m, rank)`` normal block per compressed gradient, in layout order; buckets
    are visited in launch order.
    """

    rng = np.random.RandomState(seed)
    dtype = torch_dtype(next(iter(weights.values())).dtype)
    qs: dict[int, list[np.ndarray]] = {}
    for _ in range(steps):
        for b, bucket in enumerate(plan.buckets):
            generator = torch.Generator().manual_seed(int(rng.randint(1_000_000_000)))
            _, _, mats = bucket_matrices(weights, plan, bucket)
            qs[b] = [
                torch.randn(1, m, min(n, m, POWERSGD_RANK), generator=generator, dtype=dtype)[0]
                .float()
                .numpy()
                .astype(np.float64)
                for n, m in mats
            ]
    return qs
