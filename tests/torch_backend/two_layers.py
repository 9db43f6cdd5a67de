"""A model whose layers can be converted one alone, for the tests of a module converted
behind the DDP's back (``ddp.module.b.double()``)."""

from __future__ import annotations

import torch
from torch import nn


class TwoLayers(nn.Module):
    """Two layers, the second fed in its own dtype (so either alone can be converted)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).to(self.b.weight.dtype))
