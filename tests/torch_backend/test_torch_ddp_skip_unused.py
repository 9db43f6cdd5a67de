"""``skip_all_reduce_unused_params`` when the ranks' unused parameters differ, on gloo.

PyTorch's DDP skips each bucket this rank did not use; ranks that used different
parameters then enter different collectives and gloo aborts the process (SIGABRT), also
under ``join()``. xgrad sums the used map at the start of the backward pass and skips only
buckets no rank used: the same buckets as PyTorch's where the ranks agree, and the
averaged gradients (not a crash) where they do not. Small buckets (one per parameter) so
that a bucket can be unused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from xgrad.torch_backend.spawn import spawn

TINY = 0.00001  # MiB: a bucket per parameter


class ThreeWay(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 2)
        self.c = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor, use: str) -> torch.Tensor:
        return getattr(self, use)(torch.tanh(self.a(x)))


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _same(x: dict[str, Any], y: dict[str, Any]) -> bool:
    return x.keys() == y.keys() and all(
        (x[k] is None and y[k] is None)
        or (x[k] is not None and y[k] is not None and torch.equal(x[k], y[k]))
        for k in x
    )


def _cases(rank: int, world: int) -> dict[str, bool]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    kw: dict[str, Any] = {"find_unused_parameters": True, "skip_all_reduce_unused_params": True}
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    out = {}

    def train(cls: Any, use: str, cap: float | None, steps: int = 2) -> dict[str, Any]:
        torch.manual_seed(0)
        model = ThreeWay()
        ddp = cls(model, **kw, **({} if cap is None else {"bucket_cap_mb": cap}))
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            ddp(x * (step + 1), use).sum().backward()
        return _grads(model)

    # The ranks agree (c unused everywhere): PyTorch's gradients, c's left None.
    out["agree"] = _same(train(DistributedDataParallel, "b", TINY), train(TorchDDP, "b", TINY))

    # Rank 0 uses b, rank 1 uses c: the average of what each rank computed, on both.
    use = "b" if rank == 0 else "c"
    ours = train(DistributedDataParallel, use, TINY, steps=1)
    torch.manual_seed(0)
    model = ThreeWay()
    model(x, use).sum().backward()
    want = {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)
        want[name] = g / world
    out["disagree"] = _same(ours, want)

    # Uneven inputs under join(), c unused everywhere: PyTorch's gradients (its DDP runs
    # this only with large buckets; sums of two ranks do not depend on the bucketing).
    def joined(cls: Any, cap: float | None) -> dict[str, Any]:
        torch.manual_seed(0)
        model = ThreeWay()
        ddp = cls(model, **kw, **({} if cap is None else {"bucket_cap_mb": cap}))
        g = torch.Generator().manual_seed(rank)
        with ddp.join():
            for _ in range(1 + rank):
                ddp(torch.randn(4, 5, generator=g), "b").sum().backward()
        return _grads(model)

    out["join"] = _same(joined(DistributedDataParallel, TINY), joined(TorchDDP, None))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, bool]]:
    return spawn(_cases, 2, timeout=120)


@pytest.mark.parametrize("case", ["agree", "disagree", "join"])
def test_skipped_buckets_are_agreed(results: list[dict[str, bool]], case: str) -> None:
    assert all(results[rank][case] for rank in range(2)), [r[case] for r in results]
