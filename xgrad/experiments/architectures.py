"""Parameter lists of ResNet-50, BERT-large and GPT-2, derived from their definitions.

Each model is a list of :class:`Layer` s in forward order: the parameter tensors' shapes
and the forward flops one sample costs in that layer (2 per multiply-add). Nothing is
downloaded: the shapes follow the published architectures (torchvision's ResNet-50,
Devlin et al.'s BERT-large with the pooler, Radford et al.'s 124M GPT-2), and the totals
are the well-known parameter counts (checked by the tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ARCHITECTURES", "Layer", "bert_large", "gpt2", "resnet50"]


@dataclass(frozen=True)
class Layer:
    """One layer: its parameters' shapes and its forward flops per sample."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    flops: float

    @property
    def numel(self) -> int:
        total = 0
        for shape in self.shapes:
            n = 1
            for s in shape:
                n *= s
            total += n
        return total


def _conv(name: str, cin: int, cout: int, k: int, hw: int) -> list[Layer]:
    """A bias-free convolution to an ``hw x hw`` output, then batch norm (weight, bias)."""
    conv = Layer(f"{name}.conv", ((cout, cin, k, k),), 2.0 * cin * cout * k * k * hw * hw)
    return [conv, Layer(f"{name}.bn", ((cout,), (cout,)), 4.0 * cout * hw * hw)]


def resnet50() -> list[Layer]:
    """torchvision's ResNet-50 at 224 x 224 (25,557,032 parameters)."""
    layers = _conv("conv1", 3, 64, 7, 112)
    cin = 64
    for stage, (width, blocks, hw) in enumerate(
        ((64, 3, 56), (128, 4, 28), (256, 6, 14), (512, 3, 7)), start=1
    ):
        for b in range(blocks):
            name = f"layer{stage}.{b}"
            layers += _conv(f"{name}.1", cin, width, 1, hw if b or stage == 1 else hw * 2)
            layers += _conv(f"{name}.2", width, width, 3, hw)
            layers += _conv(f"{name}.3", width, width * 4, 1, hw)
            if b == 0:
                layers += _conv(f"{name}.downsample", cin, width * 4, 1, hw)
            cin = width * 4
    layers.append(Layer("fc", ((1000, 2048), (1000,)), 2.0 * 2048 * 1000))
    return layers


def _linear(name: str, fin: int, fout: int, tokens: int) -> Layer:
    return Layer(name, ((fout, fin), (fout,)), 2.0 * fin * fout * tokens)


def _norm(name: str, d: int, tokens: int) -> Layer:
    return Layer(name, ((d,), (d,)), 5.0 * d * tokens)


def _encoder(prefix: str, d: int, ff: int, seq: int) -> list[Layer]:
    """One transformer block (attention and MLP), attention scores charged to ``.attn``."""
    return [
        _linear(f"{prefix}.qkv", d, 3 * d, seq),
        Layer(f"{prefix}.attn", (), 4.0 * seq * seq * d),
        _linear(f"{prefix}.proj", d, d, seq),
        _norm(f"{prefix}.norm1", d, seq),
        _linear(f"{prefix}.fc1", d, ff, seq),
        _linear(f"{prefix}.fc2", ff, d, seq),
        _norm(f"{prefix}.norm2", d, seq),
    ]


def bert_large(seq: int = 128) -> list[Layer]:
    """BERT-large (24 x 1024, 16 heads, 4096 MLP) with the pooler (335,141,888 parameters);
    a sample is a sequence of ``seq`` tokens."""
    d = 1024
    layers = [
        Layer("embeddings", ((30522, d), (512, d), (2, d)), 0.0),
        _norm("embeddings.norm", d, seq),
    ]
    for i in range(24):
        layers += _encoder(f"encoder.{i}", d, 4 * d, seq)
    layers.append(_linear("pooler", d, d, 1))
    return layers


def gpt2(seq: int = 1024) -> list[Layer]:
    """GPT-2 124M (12 x 768, tied output embedding; 124,439,808 parameters); a sample is
    a sequence of ``seq`` tokens, and the output projection reuses the token embedding."""
    d, vocab = 768, 50257
    layers = [Layer("wte+wpe", ((vocab, d), (1024, d)), 0.0)]
    for i in range(12):
        block = _encoder(f"h.{i}", d, 4 * d, seq)
        layers += [block[3], *block[:3], block[6], *block[4:6]]  # pre-norm order
    layers.append(_norm("ln_f", d, seq))
    layers.append(Layer("lm_head (tied)", (), 2.0 * d * vocab * seq))
    return layers


#: name -> function returning the layers.
ARCHITECTURES: dict[str, Callable[[], list[Layer]]] = {
    "resnet50": resnet50,
    "bert-large": bert_large,
    "gpt2": gpt2,
}
