"""The model zoo as data: parameter names and shapes, seeded weights and batches (numpy only).

Every zoo model is implemented twice, in torch (``xgrad.torch_backend.models``) and in pure
JAX (``xgrad.jax_backend.models``), and both read the weights made here, so one seed gives
both frameworks the very same numbers. Parameter names are torch's ``named_parameters()``
names and the dicts returned here are ordered like them; that order is the parameter index
order a ``BucketPlan`` refers to.

All zoo models use the same loss: mean squared error over every output element
(``((out - y) ** 2).mean()``, torch's ``MSELoss`` default). With equal contiguous shards
of the batch, the mean of the shard gradients is the full-batch gradient, which is what
data parallelism must reproduce.

Example:
    >>> w = init_weights("mlp", seed=0, dtype="float32")
    >>> list(w)[:2]
    ['layers.0.weight', 'layers.0.bias']
    >>> x, y = make_batch("mlp", seed=0, batch_size=4, dtype="float32")
    >>> x.shape, y.shape
    ((4, 16), (4, 8))
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import DTypeLike

if TYPE_CHECKING:
    from xgrad.model_pairs import ModelPair as ModelPair
    from xgrad.model_pairs import check_name_map as check_name_map
    from xgrad.model_pairs import resolve_pair as resolve_pair

#: a parameter name with its shape, in ``named_parameters()`` order.
ParamShapes = tuple[tuple[str, tuple[int, ...]], ...]

#: the dtypes the zoo can be made in (bfloat16 through ml_dtypes, which JAX ships with).
DTYPES: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelSpec:
    """What a zoo model is, without any framework: its parameters and its data shapes.

    Attributes:
        name: registry name (``"mlp"``, ``"cnn"``, ``"transformer"``).
        description: one line for tables and ``--help``.
        params: ``(name, shape)`` pairs in ``named_parameters()`` order.
        input_shape: one sample's input shape (the batch dimension is added in front).
        output_shape: one sample's output (and target) shape.
        init: how each parameter is drawn: maps ``(name, shape, rng)`` to float64 values.
    """

    name: str
    description: str
    params: ParamShapes
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    init: Callable[[str, tuple[int, ...], np.random.Generator], np.ndarray]

    @property
    def param_names(self) -> tuple[str, ...]:
        """Parameter names in ``named_parameters()`` order (= the plan's index order)."""
        return tuple(name for name, _ in self.params)

    @property
    def num_elements(self) -> int:
        """Total number of scalar parameters."""
        return sum(int(np.prod(shape)) for _, shape in self.params)


def _fan_in_uniform(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """torch's default Linear/Conv init bound ``1/sqrt(fan_in)``, for weights and biases alike.

    A bias takes its fan-in from the weight it goes with, which is not visible from the bias's
    shape alone; using the bias's own length instead keeps values of the same magnitude, and
    the exact distribution does not matter for comparing frameworks (only that both read it).
    """
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, size=shape)


def _transformer_init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """LayerNorm scales near one and shifts near zero, other parameters like torch's Linear.

    The LayerNorm values are perturbed (not exactly 1 and 0) so that their gradients are
    generic and a mixed-up parameter name would show in a comparison.
    """
    if name.startswith("ln") and name.endswith(".weight"):
        return 1.0 + rng.uniform(-0.1, 0.1, size=shape)
    if name.startswith("ln") and name.endswith(".bias"):
        return rng.uniform(-0.1, 0.1, size=shape)
    return _fan_in_uniform(name, shape, rng)


def _mlp_params(sizes: tuple[int, ...]) -> ParamShapes:
    """``layers.{i}.weight`` (out, in) then ``layers.{i}.bias`` (out,), layer by layer."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        out.append((f"layers.{i}.weight", (fan_out, fan_in)))
        out.append((f"layers.{i}.bias", (fan_out,)))
    return tuple(out)


#: MLP layer widths: input, hidden..., output. tanh after every layer except the last.
MLP_SIZES: tuple[int, ...] = (16, 32, 32, 8)

#: CNN: input (1, 8, 8); conv1 1->4 3x3 pad 1, tanh; conv2 4->8 3x3 stride 2 pad 1, tanh;
#: flatten (8*4*4 = 128); fc 128->4.
CNN_CHANNELS: tuple[int, int, int] = (1, 4, 8)
CNN_IMAGE: int = 8
CNN_OUT: int = 4

#: Transformer block (pre-LayerNorm): sequence length, model width, heads, MLP width.
TRANSFORMER_SEQ: int = 4
TRANSFORMER_DIM: int = 16
TRANSFORMER_HEADS: int = 2
TRANSFORMER_HIDDEN: int = 32
#: LayerNorm epsilon, torch's default, used by both implementations.
LAYER_NORM_EPS: float = 1e-5


def _cnn_params() -> ParamShapes:
    c0, c1, c2 = CNN_CHANNELS
    flat = c2 * (CNN_IMAGE // 2) ** 2
    return (
        ("conv1.weight", (c1, c0, 3, 3)),
        ("conv1.bias", (c1,)),
        ("conv2.weight", (c2, c1, 3, 3)),
        ("conv2.bias", (c2,)),
        ("fc.weight", (CNN_OUT, flat)),
        ("fc.bias", (CNN_OUT,)),
    )


def _transformer_params() -> ParamShapes:
    d, h = TRANSFORMER_DIM, TRANSFORMER_HIDDEN
    return (
        ("ln1.weight", (d,)),
        ("ln1.bias", (d,)),
        ("attn.qkv.weight", (3 * d, d)),
        ("attn.qkv.bias", (3 * d,)),
        ("attn.proj.weight", (d, d)),
        ("attn.proj.bias", (d,)),
        ("ln2.weight", (d,)),
        ("ln2.bias", (d,)),
        ("mlp.fc1.weight", (h, d)),
        ("mlp.fc1.bias", (h,)),
        ("mlp.fc2.weight", (d, h)),
        ("mlp.fc2.bias", (d,)),
    )


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(
        name="mlp",
        description=f"MLP {'-'.join(map(str, MLP_SIZES))}, tanh",
        params=_mlp_params(MLP_SIZES),
        input_shape=(MLP_SIZES[0],),
        output_shape=(MLP_SIZES[-1],),
        init=_fan_in_uniform,
    ),
    "cnn": ModelSpec(
        name="cnn",
        description=f"CNN 2 conv ({CNN_CHANNELS[0]}x{CNN_IMAGE}x{CNN_IMAGE}) + linear, tanh",
        params=_cnn_params(),
        input_shape=(CNN_CHANNELS[0], CNN_IMAGE, CNN_IMAGE),
        output_shape=(CNN_OUT,),
        init=_fan_in_uniform,
    ),
    "transformer": ModelSpec(
        name="transformer",
        description=(
            f"pre-LN transformer block (seq {TRANSFORMER_SEQ}, width {TRANSFORMER_DIM}, "
            f"{TRANSFORMER_HEADS} heads, MLP {TRANSFORMER_HIDDEN}, GELU)"
        ),
        params=_transformer_params(),
        input_shape=(TRANSFORMER_SEQ, TRANSFORMER_DIM),
        output_shape=(TRANSFORMER_SEQ, TRANSFORMER_DIM),
        init=_transformer_init,
    ),
}


def list_models() -> list[str]:
    """Names of the zoo models, sorted (pairs are named by import path, not listed)."""
    return sorted(MODELS)


def get_spec(name: str) -> ModelSpec:
    """The spec of zoo model ``name``, or of the :class:`ModelPair` ``"module:attribute"``.

    Raises:
        ValueError: ``name`` is neither a zoo model (the message lists those) nor a pair.
    """
    if is_pair_name(name):
        from xgrad.model_pairs import pair_spec

        return pair_spec(name)
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {list_models()}") from None


def param_names(name: str) -> tuple[str, ...]:
    """Parameter names of zoo model ``name`` in ``named_parameters()`` order."""
    return get_spec(name).param_names


def as_dtype(dtype: DTypeLike) -> np.dtype:
    """A numpy dtype for ``dtype`` (a name from ``DTYPES`` or a numpy dtype).

    ``"bfloat16"`` is numpy's through ml_dtypes, which JAX depends on; it is imported only
    when asked for so that the core stays numpy-only otherwise.

    Raises:
        ValueError: not one of the floating dtypes in ``DTYPES``.
    """
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r} is not a dtype; expected one of {DTYPES}") from None
    if resolved.name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; expected one of {DTYPES}")
    return resolved


def init_weights(name: str, seed: int, dtype: DTypeLike = "float32") -> dict[str, np.ndarray]:
    """Seeded weights of zoo model ``name``, ordered like torch's ``named_parameters()``.

    Values are drawn in float64 and then rounded to ``dtype``, so weights made in different
    dtypes from one seed are roundings of the same numbers.

    Args:
        name: a zoo model (``list_models()``).
        seed: the seed; the same seed gives the same weights everywhere.
        dtype: the weights' dtype (see ``DTYPES``).
    """
    spec = get_spec(name)
    target = as_dtype(dtype)
    rng = np.random.default_rng([seed, 0])
    return {
        pname: np.ascontiguousarray(spec.init(pname, shape, rng).astype(target))
        for pname, shape in spec.params
    }


def make_batch(
    name: str, seed: int, batch_size: int, dtype: DTypeLike = "float32"
) -> tuple[np.ndarray, np.ndarray]:
    """A seeded batch ``(x, y)`` for zoo model ``name``: standard normal inputs and targets.

    The batch's stream is separate from the weights' stream of the same seed.

    Raises:
        ValueError: ``batch_size`` is not a positive integer.
    """
    spec = get_spec(name)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    target = as_dtype(dtype)
    rng = np.random.default_rng([seed, 1])
    x = rng.standard_normal((batch_size, *spec.input_shape)).astype(target)
    y = rng.standard_normal((batch_size, *spec.output_shape)).astype(target)
    return x, y


def check_weights(name: str, weights: dict[str, np.ndarray]) -> None:
    """Check that ``weights`` has exactly zoo model ``name``'s parameters, in order and shape.

    Raises:
        ValueError: a missing, extra, misordered or misshaped parameter (named in the message).
    """
    spec = get_spec(name)
    expected = spec.param_names
    got = tuple(weights)
    if got != expected:
        missing = [n for n in expected if n not in weights]
        extra = [n for n in got if n not in expected]
        raise ValueError(
            f"weights for model {name!r} do not match its parameters: missing {missing}, "
            f"unexpected {extra}, order {list(got)} (expected {list(expected)})"
        )
    for pname, shape in spec.params:
        if tuple(weights[pname].shape) != shape:
            raise ValueError(
                f"parameter {pname!r} of model {name!r} has shape {tuple(weights[pname].shape)}, "
                f"expected {shape}"
            )


def shard(array: np.ndarray, world_size: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s equal contiguous shard of ``array`` along the batch dimension.

    Raises:
        ValueError: the batch does not split evenly, or ``rank`` is out of range.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} out of range for world_size={world_size}")
    n = array.shape[0]
    if n % world_size:
        raise ValueError(
            f"batch size {n} does not split evenly over world_size={world_size} (rank {rank})"
        )
    per = n // world_size
    return array[rank * per : (rank + 1) * per]


def is_pair_name(name: str) -> bool:
    """Whether ``name`` names a :class:`ModelPair` (``"module:attribute"``) rather than the zoo."""
    return ":" in name


#: names defined in :mod:`xgrad.model_pairs`, still importable from here.
_PAIR_NAMES = ("ModelPair", "resolve_pair", "check_name_map")


def __getattr__(name: str) -> Any:
    if name in _PAIR_NAMES:
        return getattr(importlib.import_module("xgrad.model_pairs"), name)
    raise AttributeError(f"module 'xgrad.models' has no attribute {name!r}")
