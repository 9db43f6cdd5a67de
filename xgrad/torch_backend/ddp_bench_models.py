"""The models of ``xgrad bench ddp``: each at a full and a tiny (smoke-run) size."""

from __future__ import annotations

import itertools

import torch
from torch import nn

__all__ = ["MODELS", "SCALES", "build"]

MODELS = ("mlp", "transformer", "many", "many1000")

#: model -> (description for the table, sizes at "full" and "tiny" scale).
SCALES: dict[str, dict[str, dict[str, int]]] = {
    "mlp": {
        "full": {"width": 1024, "depth": 3, "inputs": 512, "batch": 32},
        "tiny": {"width": 32, "depth": 2, "inputs": 16, "batch": 4},
    },
    "transformer": {
        "full": {"dim": 128, "layers": 2, "heads": 4, "seq": 32, "vocab": 2000, "batch": 8},
        "tiny": {"dim": 16, "layers": 1, "heads": 2, "seq": 4, "vocab": 50, "batch": 2},
    },
    "many": {
        "full": {"blocks": 110, "width": 32, "batch": 32},
        "tiny": {"blocks": 101, "width": 4, "batch": 2},
    },
    # 1,000 parameter tensors: where the per-gradient hook cost decides the step time.
    "many1000": {
        "full": {"blocks": 500, "width": 16, "batch": 16},
        "tiny": {"blocks": 500, "width": 2, "batch": 2},
    },
}


def build(name: str, sizes: dict[str, int]) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model, one input batch and its targets, seeded the same on every rank."""
    torch.manual_seed(0)
    if name == "mlp":
        dims = [sizes["inputs"]] + [sizes["width"]] * sizes["depth"] + [10]
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            layers += [nn.Linear(a, b), nn.Tanh()]
        model: nn.Module = nn.Sequential(*layers[:-1])
        x = torch.randn(sizes["batch"], sizes["inputs"])
        return model, x, torch.randn(sizes["batch"], 10)
    if name == "transformer":
        model = _TinyTransformer(sizes)
        x = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq"]))
        return model, x, torch.randn(sizes["batch"], sizes["seq"], sizes["dim"])
    model = _ManySmall(sizes["blocks"], sizes["width"])  # many, many1000
    x = torch.randn(sizes["batch"], sizes["width"])
    return model, x, torch.randn(sizes["batch"], sizes["width"])


class _TinyTransformer(nn.Module):
    """Token embedding and a few pre-norm encoder layers (training mode: no fast path)."""

    def __init__(self, s: dict[str, int]) -> None:
        super().__init__()
        self.embed = nn.Embedding(s["vocab"], s["dim"])
        layer = nn.TransformerEncoderLayer(
            s["dim"], s["heads"], 4 * s["dim"], dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, s["layers"], enable_nested_tensor=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(tokens))  # type: ignore[no-any-return]


class _ManySmall(nn.Module):
    """A residual chain of small linear layers: two parameter tensors per block."""

    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + 0.1 * torch.tanh(block(x))
        return x
