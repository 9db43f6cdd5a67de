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

from xgrad.buckets import BucketPlan
from xgrad.powersgd import PowerSGD
from xgrad.powersgd_hook import initial_qs as core_initial_qs
from xgrad.torch_backend.models import torch_dtype

__all__ = ["initial_qs", "powersgd_sampler", "torch_sampler"]


def torch_sampler(seed: int, shapes: Sequence[tuple[int, int]], dtype: str) -> list[np.ndarray]:
    """``torch.randn`` blocks as ``powerSGD_hook`` draws them after ``manual_seed(seed)``."""
    generator = torch.Generator().manual_seed(int(seed))
    wanted = torch_dtype(dtype)
    return [
        torch.randn(1, m, r, generator=generator, dtype=wanted)[0].double().numpy()
        for m, r in shapes
    ]


#: the name the registry looks for (see ``xgrad.backend.find_sampler``).
powersgd_sampler = torch_sampler


def initial_qs(
    weights: Mapping[str, np.ndarray],
    plan: BucketPlan,
    steps: int,
    seed: int = 0,
    config: PowerSGD | None = None,
) -> dict[int, list[np.ndarray]]:
    """The fresh ``Q`` torch's ``powerSGD_hook`` draws at its ``steps``-th draw round.

    :func:`xgrad.powersgd_hook.initial_qs` with torch's sampler.
    """
    return core_initial_qs(weights, plan, steps, seed, config, torch_sampler)
