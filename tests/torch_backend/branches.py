"""A model of a shared layer and two branches, for the DDP tests of passes that leave a
branch's parameters unused (``find_unused_parameters``, a validation pass through other
parameters than the pass after it)."""

from __future__ import annotations

import torch
from torch import nn


class Branches(nn.Module):
    """A shared layer, then branch ``a``, ``b`` or both (``"ab"``), their outputs summed;
    ``out``: the branches' width."""

    def __init__(self, out: int = 3) -> None:
        super().__init__()
        self.s = nn.Linear(4, 4)
        self.a = nn.Linear(4, out)
        self.b = nn.Linear(4, out)

    def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        h = torch.tanh(self.s(x))
        out = torch.zeros(())
        if "a" in branch:
            out = out + self.a(h)
        if "b" in branch:
            out = out + self.b(h)
        return out
