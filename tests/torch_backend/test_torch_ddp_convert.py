"""A DDP converted after it was made (``ddp.double()``) reduces in the new dtype.

The buckets kept the dtype they were made with: float64 gradients went through float32
buckets, on every later step (about 5e-9 off the mean; the first iteration's rebuild
hid it when the conversion came before any step). PyTorch's DDP leaves each rank its
local gradient then, without a word. On two gloo ranks (dividing by two is exact, so the
mean of the local gradients is the reduced one bit for bit).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from xgrad.torch_backend.spawn import spawn

STEPS = 4


def _run(rank: int, world: int, when: int, view: bool) -> list[float]:
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=view, timeout=20)
    errors = []
    for step in range(STEPS):
        if step == when:
            ddp.double()
        dtype = torch.float64 if step >= when else torch.float32
        model.zero_grad()
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(5, 6, dtype=dtype, generator=g)
        ddp(x).pow(2).mean().backward()
        local = copy.deepcopy(model)
        local.zero_grad()
        local(x).pow(2).mean().backward()
        worst = 0.0
        for p, q in zip(model.parameters(), local.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert p.grad.dtype == dtype
            mean = q.grad.clone()
            dist.all_reduce(mean)
            mean /= world
            worst = max(worst, float((p.grad - mean).abs().max()))
        errors.append(worst)
    return errors


@pytest.mark.parametrize(("when", "view"), [(0, False), (2, False), (2, True)])
def test_gradients_are_reduced_in_the_dtype_the_parameters_have(when: int, view: bool) -> None:
    results: Any = spawn(_run, 2, args=(when, view), timeout=90)
    for errors in results:
        assert errors == [0.0] * STEPS, errors
