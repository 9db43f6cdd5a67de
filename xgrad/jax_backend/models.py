"""The zoo models as pure JAX functions of a ``{name: array}`` dict (torch twins: torch_backend.models).

Each function is written operation by operation like its torch twin (same layouts: Linear
weights are ``(out, in)`` and applied as ``x @ W.T + b``; convolutions are NCHW/OIHW), so
the two differ only by the order in which the frameworks' kernels round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xgrad import models as zoo

#: parameters as a flat dict keyed by torch's parameter names (a pytree JAX differentiates).
Params = Mapping[str, Any]
#: ``apply(params, x) -> output``.
ApplyFn = Callable[[Params, Any], Any]


def _linear(params: Params, prefix: str, x: Any) -> Any:
    return x @ params[f"{prefix}.weight"].T + params[f"{prefix}.bias"]


def mlp(params: Params, x: Any) -> Any:
    """``layers.{i}`` linear layers with tanh between them (not after the last)."""
    n = sum(1 for k in params if k.startswith("layers.") and k.endswith(".weight"))
    for i in range(n):
        x = _linear(params, f"layers.{i}", x)
        if i != n - 1:
            x = jnp.tanh(x)
    return x


def _conv(params: Params, prefix: str, x: Any, stride: int) -> Any:
    out = jax.lax.conv_general_dilated(
        x,
        params[f"{prefix}.weight"],
        window_strides=(stride, stride),
        padding=((1, 1), (1, 1)),
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
    )
    return out + params[f"{prefix}.bias"][None, :, None, None]


def cnn(params: Params, x: Any) -> Any:
    """conv1 (pad 1), tanh, conv2 (stride 2, pad 1), tanh, flatten, fc."""
    x = jnp.tanh(_conv(params, "conv1", x, 1))
    x = jnp.tanh(_conv(params, "conv2", x, 2))
    return _linear(params, "fc", x.reshape(x.shape[0], -1))


def _layer_norm(params: Params, prefix: str, x: Any) -> Any:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    normed = (x - mean) / jnp.sqrt(var + zoo.LAYER_NORM_EPS)
    return normed * params[f"{prefix}.weight"] + params[f"{prefix}.bias"]


def _attention(params: Params, x: Any) -> Any:
    b, t, d = x.shape
    heads = zoo.TRANSFORMER_HEADS
    dh = d // heads
    qkv = _linear(params, "attn.qkv", x)
    q, k, v = (a.reshape(b, t, heads, dh).transpose(0, 2, 1, 3) for a in jnp.split(qkv, 3, axis=-1))
    scores = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(dh)
    out = jax.nn.softmax(scores, axis=-1) @ v
    return _linear(params, "attn.proj", out.transpose(0, 2, 1, 3).reshape(b, t, d))


def transformer(params: Params, x: Any) -> Any:
    """Pre-LayerNorm block: ``x + attn(ln1(x))`` then ``x + fc2(gelu(fc1(ln2(x))))``."""
    x = x + _attention(params, _layer_norm(params, "ln1", x))
    hidden = jax.nn.gelu(_linear(params, "mlp.fc1", _layer_norm(params, "ln2", x)), False)
    return x + _linear(params, "mlp.fc2", hidden)


APPLY: dict[str, ApplyFn] = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def get_apply(model_name: str) -> ApplyFn:
    """The JAX forward function of zoo model ``model_name``, over torch-named parameters.

    For a :class:`~xgrad.models.ModelPair` (``"module:attribute"``) the pair's function is
    wrapped so that it, too, takes parameters keyed by torch's names, renamed through the
    pair's checked name map on the way in.

    Raises:
        ValueError: unknown model (the message lists the known ones), or a bad name map.
    """
    if zoo.is_pair_name(model_name):
        pair = zoo.resolve_pair(model_name)
        mapping = zoo.check_name_map(pair, zoo.param_names(model_name))

        def renamed(params: Params, x: Any) -> Any:
            return pair.jax_apply({mapping[k]: v for k, v in params.items()}, x)

        return renamed
    try:
        return APPLY[model_name]
    except KeyError:
        raise ValueError(
            f"unknown model {model_name!r}; known models: {zoo.list_models()}"
        ) from None


def mse(output: Any, target: Any) -> Any:
    """The zoo's loss: mean squared error over all elements (torch's ``MSELoss`` default)."""
    return ((output - target) ** 2).mean()


def make_loss(apply: ApplyFn) -> Callable[[Params, Any, Any], Any]:
    """``loss(params, x, y) = mse(apply(params, x), y)``, the function a data-parallel step differentiates."""

    def loss(params: Params, x: Any, y: Any) -> Any:
        return mse(apply(params, x), y)

    return loss


def to_params(weights: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """``weights`` as JAX arrays, same names, order and dtype.

    Raises:
        ValueError: float64 weights while JAX's 64-bit mode is off (JAX would round them to
            float32 and the comparison would measure that rounding).
    """
    if not getattr(jax.config, "jax_enable_x64", False):
        wide = [k for k, v in weights.items() if np.dtype(v.dtype) == np.float64]
        if wide:
            raise ValueError(
                f"parameters {wide[:3]} are float64 but JAX's 64-bit mode is off; "
                "run under `with jax.enable_x64(True):`"
            )
    return {k: jnp.asarray(v) for k, v in weights.items()}
