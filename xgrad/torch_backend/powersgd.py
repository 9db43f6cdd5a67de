"""Torch's PowerSGD random draws, replayed so other backends start from the same ``Q``.

PyTorch's ``powerSGD_hook`` seeds torch's generator with each seed its ``RandomState``
hands out and draws one ``(1, m, rank)`` normal block per compressed gradient in the
gradient's dtype. :func:`torch_sampler` does the same, as a :data:`xgrad.powersgd.Sampler`,
so xgrad's core PowerSGD (and through it JAX and the float64 truth) starts from torch's
very numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from xgrad import models as zoo
from xgrad.buckets import BucketPlan
from xgrad.powersgd import PowerSGD, layout
from xgrad.powersgd_hook import PowerSGDState
from xgrad.torch_backend.models import torch_dtype

__all__ = ["initial_qs", "torch_sampler"]


def torch_sampler(seed: int, shapes: Sequence[tuple[int, int]], dtype: str) -> list[np.ndarray]:
    """``torch.randn`` blocks as ``powerSGD_hook`` draws them after ``manual_seed(seed)``."""
    generator = torch.Generator().manual_seed(int(seed))
    wanted = torch_dtype(dtype)
    return [
        torch.randn(1, m, r, generator=generator, dtype=wanted)[0].double().numpy()
        for m, r in shapes
    ]


def initial_qs(
    weights: Mapping[str, np.ndarray],
    plan: BucketPlan,
    steps: int,
    seed: int = 0,
    config: PowerSGD | None = None,
) -> dict[int, list[np.ndarray]]:
    """The fresh ``Q`` torch's ``powerSGD_hook`` draws at its ``steps``-th draw per bucket.

    Torch draws fresh ``Q`` for every bucket at every PowerSGD step without warm start,
    and only at the first one with it (``steps=1``); buckets are visited in launch order
    and every bucket consumes a seed, compressed gradients or not.

    Returns:
        bucket index -> one ``(m, rank)`` float64 array per compressed gradient, in the
        bucket's :func:`~xgrad.powersgd.layout` order.
    """
    cfg = config or PowerSGD(
        start_powerSGD_iter=1, use_error_feedback=False, warm_start=False, random_seed=seed
    )
    state = PowerSGDState(cfg, sampler=torch_sampler)
    names = list(weights)
    dtype = zoo.as_dtype(next(iter(weights.values())).dtype).name
    qs: dict[int, list[np.ndarray]] = {}
    for _ in range(steps):
        for b, bucket in enumerate(plan.buckets):
            lay = layout(
                [weights[names[i]].shape for i in bucket],
                cfg.matrix_approximation_rank,
                cfg.min_compression_rate,
            )
            seed_b = int(state.rng.randint(1_000_000_000))
            qs[b] = state.sampler(seed_b, lay.q_shapes, dtype)
    return qs
