"""Two ``sparse=True`` embeddings fed one upstream gradient: each is averaged on its own.

``e(i) + e2(i)``: autograd gives both embeddings sparse gradients that share one values
tensor. PyTorch's DDP divides and all-reduces each sparse gradient in place, so the two
reductions run into each other (one comes out at half the mean, the other varies from
run to run). xgrad's reduces a copy of each: on two gloo ranks both are the mean of the
ranks' own gradients.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn


class _TwoSparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(20, 4, sparse=True)
        self.e2 = nn.Embedding(20, 4, sparse=True)
        self.out = nn.Linear(4, 2)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.out(self.e(i) + self.e2(i))


def _errors(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    base = _TwoSparse()
    model, local = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DistributedDataParallel(model)
    i = torch.randint(0, 20, (6,), generator=torch.Generator().manual_seed(rank))
    for m in (ddp, local):
        m(i).square().sum().backward()
    errors = []
    for name, p in model.named_parameters():
        mine = dict(local.named_parameters())[name].grad
        assert mine is not None and p.grad is not None
        mine = mine.to_dense()
        every: list[Any] = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        errors.append(float((p.grad.to_dense() - sum(every) / world).abs().max()))
    return errors


def test_sparse_gradients_sharing_their_values_are_each_averaged() -> None:
    for errors in spawn(_errors, 2, timeout=60):
        assert max(errors) < 1e-6, errors
