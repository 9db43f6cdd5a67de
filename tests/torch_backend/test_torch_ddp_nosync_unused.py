"""``find_unused_parameters`` with ``no_sync`` accumulation, against PyTorch's DDP on gloo.

A parameter used only in a ``no_sync`` micro-batch, not in the synchronised one that
follows, is still averaged over the ranks: PyTorch's local used map keeps counting during
``no_sync``, and a parameter unused in a pass puts its ``.grad`` (what the accumulation
left) in its bucket. xgrad left such a gradient local, so the ranks drifted apart. Also
the same parameter used by one rank only, with gradients as bucket views, and a gradient
never zeroed across steps while its parameter is unused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_c: bool) -> torch.Tensor:
        h = self.a(x)
        return h + self.c(h) if use_c else h


def _grads(model: nn.Module) -> dict[str, Any]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _case(rank: int, cls: Any, case: str) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = Branchy()
    ddp = cls(model, find_unused_parameters=True, gradient_as_bucket_view=case == "view")
    x = torch.full((2, 4), float(rank + 1))
    out = []
    for step in range(3):
        if case != "stale":
            model.zero_grad(set_to_none=True)
        with ddp.no_sync():
            use = rank == 0 if case == "one_rank" else True
            ddp(x * (step + 1), use).sum().backward()
        ddp(x, False).sum().backward()
        out.append(_grads(model))
    return out


def _cases(rank: int, world: int) -> dict[str, bool]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    same = {}
    for case in ("both_ranks", "one_rank", "view", "stale"):
        theirs = _case(rank, TorchDDP, case)
        ours = _case(rank, DistributedDataParallel, case)
        same[case] = all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for t, x in zip(theirs, ours, strict=True)
            for a, b in zip(t.values(), x.values(), strict=True)
        )
    return same


@pytest.fixture(scope="module")
def results() -> list[dict[str, bool]]:
    return spawn(_cases, 2, timeout=120)


@pytest.mark.parametrize("case", ["both_ranks", "one_rank", "view", "stale"])
def test_gradients_equal_pytorchs(results: list[dict[str, bool]], case: str) -> None:
    assert all(results[rank][case] for rank in range(2)), [r[case] for r in results]
