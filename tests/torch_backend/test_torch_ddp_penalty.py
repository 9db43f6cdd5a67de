"""A gradient penalty (double backward) through xgrad's DDP, on two gloo ranks.

``torch.autograd.grad(out, x, create_graph=True)``, then ``backward`` of the loss plus a
penalty on that gradient: the parameters' gradients must be the mean over the ranks of
each rank's local gradient, plain, with ``find_unused_parameters`` and with
``static_graph``. PyTorch 2.13's DDP with ``static_graph=True`` leaves each rank's local
gradient here, every step and without a word (the ranks drift apart; found by a probe
running both side by side); xgrad's gives the mean in every mode.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _data(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g, dtype=torch.float64)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.requires_grad_()
    out = model(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.pow(2).mean() + gx.pow(2).sum()


def _run(rank: int, world: int, options: dict[str, Any]) -> list[list[torch.Tensor]]:
    from xgrad.torch_backend import DistributedDataParallel

    ddp = DistributedDataParallel(_model(), **options)
    grads = []
    for step in range(STEPS):
        ddp.zero_grad(set_to_none=True)
        _loss(ddp, _data(rank, step)).backward()
        grads.append([p.grad.clone() for p in ddp.parameters()])
    return grads


@pytest.mark.parametrize(
    "options", [{}, {"find_unused_parameters": True}, {"static_graph": True}], ids=str
)
def test_a_gradient_penalty_gives_the_mean_of_the_ranks_local_gradients(
    options: dict[str, Any],
) -> None:
    results = spawn(_run, 2, args=(options,), timeout=90)
    local = _model()
    for step in range(STEPS):
        per_rank = []
        for rank in range(2):
            local.zero_grad(set_to_none=True)
            _loss(local, _data(rank, step)).backward()
            per_rank.append([p.grad.clone() for p in local.parameters()])
        want = [(a + b) / 2 for a, b in zip(*per_rank, strict=True)]
        for rank in range(2):
            for got, w in zip(results[rank][step], want, strict=True):
                assert torch.allclose(got, w, rtol=1e-12, atol=1e-14), (options, step, rank)
