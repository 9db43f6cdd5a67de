"""``delay_all_reduce_named_params`` when the hooked gradient comes before a delayed one.

A layer's bias hooked and its weight delayed: autograd computes the bias's gradient
first, so PyTorch's DDP reduces the delayed buffer before the weight's gradient is in
it (its result then races with the accumulation: the ranks keep different, unaveraged
gradients without an error). xgrad's reduces it at the end of the pass instead, once
every delayed gradient came: on two gloo ranks, the weight's gradient is the mean of
the ranks' own, on both, pass after pass.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn


def _delayed_first(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model, local = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DistributedDataParallel(
        model,
        delay_all_reduce_named_params=[("0.weight", model[0].weight)],
        param_to_hook_all_reduce=model[0].bias,
    )
    errors = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        for m in (ddp, local):
            m.zero_grad(set_to_none=step % 2 == 0)
            m(x).square().sum().backward()
        mine = local[0].weight.grad
        assert mine is not None and model[0].weight.grad is not None
        every: list[Any] = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        mean = sum(every) / world
        errors.append(float((model[0].weight.grad - mean).abs().max()))
    return errors


def test_a_delayed_gradient_after_the_hooked_one_is_still_averaged() -> None:
    for errors in spawn(_delayed_first, 2, timeout=60):
        assert max(errors) < 1e-6, errors
