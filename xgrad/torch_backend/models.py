"""The zoo models in torch, built from ``xgrad.models`` weights (JAX twins: jax_backend.models)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from xgrad import models as zoo


class MLP(nn.Module):
    """Linear layers in ``self.layers`` (so names are ``layers.{i}.weight``), tanh between them."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(sizes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i != last:
                x = torch.tanh(x)
        return x


class CNN(nn.Module):
    """Two 3x3 convolutions (the second with stride 2), tanh after each, then one linear layer."""

    def __init__(self) -> None:
        super().__init__()
        c0, c1, c2 = zoo.CNN_CHANNELS
        self.conv1 = nn.Conv2d(c0, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, stride=2, padding=1)
        self.fc = nn.Linear(c2 * (zoo.CNN_IMAGE // 2) ** 2, zoo.CNN_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.conv1(x))
        x = torch.tanh(self.conv2(x))
        return self.fc(x.flatten(1))


class Attention(nn.Module):
    """Multi-head self-attention written out (one fused qkv projection), without masking.

    Written by hand rather than with ``nn.MultiheadAttention`` so that the arithmetic is the
    same, operation by operation, as the JAX twin; fused fast paths would not be.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        dh = d // self.heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (a.reshape(b, t, self.heads, dh).transpose(1, 2) for a in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(dh)
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """``fc2(gelu(fc1(x)))`` with the exact (erf) GELU."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self) -> None:
        super().__init__()
        d = zoo.TRANSFORMER_DIM
        self.ln1 = nn.LayerNorm(d, eps=zoo.LAYER_NORM_EPS)
        self.attn = Attention(d, zoo.TRANSFORMER_HEADS)
        self.ln2 = nn.LayerNorm(d, eps=zoo.LAYER_NORM_EPS)
        self.mlp = FeedForward(d, zoo.TRANSFORMER_HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _empty(name: str) -> nn.Module:
    if zoo.is_pair_name(name):
        module = zoo.resolve_pair(name).torch_module()
        if not isinstance(module, nn.Module):
            raise TypeError(f"model {name!r}: torch_module() gave {type(module).__name__}")
        return module
    if name == "mlp":
        return MLP(zoo.MLP_SIZES)
    if name == "cnn":
        return CNN()
    if name == "transformer":
        return TransformerBlock()
    raise ValueError(f"unknown model {name!r}; known models: {zoo.list_models()}")


def torch_dtype(dtype: np.dtype | str) -> torch.dtype:
    """The torch dtype of a numpy dtype (or dtype name) from ``xgrad.models.DTYPES``."""
    resolved = zoo.as_dtype(dtype)
    return {
        "float64": torch.float64,
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
    }[resolved.name]


def to_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch tensor with ``array``'s values and dtype (bfloat16 included, which numpy lacks)."""
    dtype = torch_dtype(array.dtype)
    if dtype is torch.bfloat16:
        # torch cannot read ml_dtypes' bfloat16 buffers; float32 holds every bfloat16 exactly.
        return torch.from_numpy(np.asarray(array, dtype=np.float32)).to(dtype)
    return torch.from_numpy(np.array(array, copy=True))


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as a numpy array of the same dtype (bfloat16 as ml_dtypes' bfloat16)."""
    t = tensor.detach().cpu()
    if t.dtype is torch.bfloat16:
        return t.float().numpy().astype(zoo.as_dtype("bfloat16"))
    return t.numpy().copy()


def build(model_name: str, weights: dict[str, np.ndarray]) -> nn.Module:
    """Zoo model (or pair) ``model_name`` in torch holding ``weights`` (copied), in their dtype.

    ``named_parameters()`` yields exactly ``weights``' names in ``weights``' order.

    Raises:
        ValueError: unknown model, or weights that do not match its parameters (named).
    """
    zoo.check_weights(model_name, weights)
    module = _empty(model_name)
    dtype = torch_dtype(next(iter(weights.values())).dtype)
    module = module.to(dtype)
    with torch.no_grad():
        for pname, param in module.named_parameters():
            param.copy_(to_tensor(weights[pname]))
    return module


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The zoo's loss: mean squared error over all elements (torch's ``MSELoss`` default)."""
    return F.mse_loss(output, target)


def single_process_grads(
    model_name: str,
    weights: dict[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    *,
    dtype: str = "float64",
) -> dict[str, np.ndarray]:
    """Full-batch gradients of the zoo's loss in one process, computed in ``dtype``.

    The crosscheck's reference: the weights and batch are converted exactly to float64
    (every float16, bfloat16 and float32 value is a float64 value) and differentiated there,
    so every backend is measured against a value more exact than any of them.

    Returns:
        ``{name: gradient}`` in ``weights``' order, as ``dtype`` numpy arrays.
    """
    target = zoo.as_dtype(dtype)
    wide = {k: np.asarray(v, dtype=target) for k, v in weights.items()}
    module = build(model_name, wide)
    value = loss(
        module(to_tensor(np.asarray(x, dtype=target))), to_tensor(np.asarray(y, dtype=target))
    )
    value.backward()
    grads: dict[str, np.ndarray] = {}
    for pname, param in module.named_parameters():
        if param.grad is None:
            grads[pname] = np.zeros_like(wide[pname])
        else:
            grads[pname] = to_numpy(param.grad)
    return grads
