"""xgrad's DDP with a sparse embedding against the same model on one process.

A scenario of ``test_torch_cuda``'s DDP group: on CUDA that group is NCCL, which has no
sparse all-reduce (PyTorch's DDP refuses sparse gradients there), so xgrad's sums the
sparse bucket by all-gather; on the CPU's gloo, which all-reduces sparse tensors itself,
the all-gather is forced. Kept apart so that file does not grow for it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


class SparseNet(nn.Module):
    """A sparse embedding summed per sample, then a linear layer: no batch statistics, so
    one process over every rank's batch computes what the DDP averages."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, sparse=True)
        self.out = nn.Linear(6, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx).sum(1))  # type: ignore[no-any-return]


def _batches(rank: int, device: torch.device, steps: int, shard: int) -> list[Any]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (
            torch.randint(0, 10, (shard, 3), generator=g).to(device),
            torch.randn(shard, 3, generator=g, dtype=torch.float64).to(device),
        )
        for _ in range(steps)
    ]


def _dense(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).detach()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def sparse_alone(rank: int, device: torch.device, *, steps: int, shard: int) -> dict[str, Any]:
    """``steps`` SGD steps through xgrad's DDP (float64) and through one process fed every
    rank's batch: the largest difference of a gradient relative to the one process's
    largest entry, and whether the sparse bucket was summed by all-gather."""
    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.sparse_gather import gathers_sparse

    world = dist.get_world_size()
    torch.manual_seed(0)
    base = SparseNet().double().to(device)
    model, alone = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    if device.type == "cpu":
        ddp.comm._gather_sparse = True
    gathered = ddp.comm._gather_sparse or gathers_sparse(ddp.comm.group, device)
    batches = [_batches(r, device, steps, shard) for r in range(world)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, alone)]
    worst = 0.0
    for step in range(steps):
        for opt in optimizers:
            opt.zero_grad()
        x, y = batches[rank][step]
        ((ddp(x) - y) ** 2).mean().backward()
        losses = [((alone(xr) - yr) ** 2).mean() for xr, yr in (b[step] for b in batches)]
        (sum(losses) / world).backward()
        ours, reference = _dense(model), _dense(alone)
        assert ours.keys() == reference.keys(), (sorted(ours), sorted(reference))
        for name, q in reference.items():
            scale = max(float(q.abs().max()), 1e-12)
            worst = max(worst, float((ours[name] - q).abs().max()) / scale)
        for opt in optimizers:
            opt.step()
    return {"gathered": bool(gathered), "worst": worst}
