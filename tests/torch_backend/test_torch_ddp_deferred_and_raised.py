"""A step that fails on one rank as a pass left unreduced and on another as a raise.

A static graph whose graph changes on both ranks in one step, each its own way: rank 0
leaves a parameter out (its gradient never comes: the pass ends, and the error is
PyTorch's "prior iteration" one, deferred to the next forward pass), rank 1 uses one it
had left out (its hook raises at once, naming rank 0's failure, posted first). Rank 1
began the next step clean while rank 0 raised there, and from then on each of rank 1's
steps was averaged with rank 0's step after it, without a word; the last one waited out
the timeout. Now rank 1 raises the deferred failure at that forward pass too, and the
steps after are the mean of the same step on both ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn

STEPS = 6


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.c = nn.Linear(16, 4)
        self.d = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_d: bool) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.c(h) + self.d(h) if use_d else self.c(h)


def _uses_d(rank: int, step: int) -> bool:
    """Rank 0 uses ``d`` and rank 1 does not, but in step 1, where they swap."""
    return rank == 1 if step == 1 else rank == 0


def _run(rank: int, world: int) -> dict[str, Any]:
    import copy

    import torch.distributed as dist

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = _Branch()
    plain = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, find_unused_parameters=True, static_graph=True, timeout=3)
    outcomes, right = [], []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        model.zero_grad(set_to_none=True)
        try:
            ddp(x, _uses_d(rank, step)).square().sum().backward()
        except Exception as exc:  # the outcome is what is compared
            outcomes.append(type(exc).__name__)
            continue
        outcomes.append("ok")
        if step >= 3:
            plain.zero_grad(set_to_none=True)
            plain(x, _uses_d(rank, step)).square().sum().backward()
            for p, q in zip(model.parameters(), plain.parameters(), strict=True):
                local = torch.zeros_like(q) if q.grad is None else q.grad.clone()
                dist.all_reduce(local)
                right.append(p.grad is not None and torch.allclose(p.grad, local / world))
    return {"outcomes": outcomes, "right": right}


def test_every_rank_raises_the_deferred_failure_at_the_same_forward_pass() -> None:
    first, second = spawn(_run, 2, timeout=90)
    assert first["outcomes"] == ["ok", "ok", "RuntimeError", "ok", "ok", "ok"]
    assert second["outcomes"] == ["ok", "RankError", "RankError", "ok", "ok", "ok"]
    assert first["right"] and all(first["right"]) and all(second["right"])
