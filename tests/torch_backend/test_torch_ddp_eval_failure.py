"""A DDP forward that raises under ``torch.no_grad()`` (an evaluation) stays on its rank.

Such a forward begins no step and no peer waits for it, yet its failure was posted to
the DDP's step: the other ranks raised it at their next training step, which had not
failed. PyTorch's DDP raises it on the failing rank only too.
"""

from __future__ import annotations

import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn


class _Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("boom in eval")
        return self.lin(x)


def _run(rank: int, world: int) -> list[str]:
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    module = _Flaky()
    ddp = DistributedDataParallel(module, timeout=10)
    x = torch.randn(4, 3)
    out = []
    module.fail = rank == 0
    with torch.no_grad():
        try:
            ddp(x)
            out.append("eval ran")
        except ValueError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    module.fail = False
    for _ in range(2):
        try:
            ddp(x).sum().backward()
            out.append("step ok")
        except Exception as exc:
            out.append(f"step raised {type(exc).__name__}: {exc}")
    return out


def test_a_forward_that_raises_under_no_grad_fails_its_rank_alone() -> None:
    results = spawn(_run, 2, timeout=90)
    assert results[0] == ["ValueError: boom in eval", "step ok", "step ok"], results[0]
    assert results[1] == ["eval ran", "step ok", "step ok"], results[1]
