"""Bring your own model: a torch module and a JAX function that compute the same thing.

A :class:`ModelPair` is named by where it can be imported from (``"package.module:NAME"``)
and is then used wherever a zoo model's name is; its spec (parameter names and shapes) is
read from the torch module itself.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xgrad.models import ModelSpec, _fan_in_uniform

__all__ = ["ModelPair", "check_name_map", "pair_spec", "resolve_pair"]


@dataclass(frozen=True)
class ModelPair:
    """Bring your own model: a torch module and a JAX function that compute the same thing.

    A pair is named by where it can be imported from, ``"package.module:attribute"``, and
    that string is used wherever a zoo name is (``xgrad crosscheck --model pkg.mod:PAIR``),
    because every torch rank is a fresh process that must build the model by itself.
    Parameters keep torch's names and ``named_parameters()`` order everywhere (plans index
    them so); ``name_map`` says under which key the JAX function finds each of them.
    Weights are drawn like the zoo's (uniform, ``1/sqrt(fan_in)``) from the seed.

    Attributes:
        torch_module: makes the ``torch.nn.Module`` (its initial values are overwritten).
        jax_apply: ``apply(params, x) -> output`` with ``params`` a flat dict keyed by the
            JAX names.
        input_shape: one sample's input shape.
        output_shape: one sample's output (and target) shape; the loss is the zoo's MSE.
        name_map: torch parameter name -> JAX key; None when the names are the same.
        description: one line for the report.

    Example (in ``mypkg/pairs.py``)::

        PAIR = ModelPair(
            torch_module=lambda: torch.nn.Sequential(torch.nn.Linear(4, 2)),
            jax_apply=lambda p, x: x @ p["w"].T + p["b"],
            input_shape=(4,), output_shape=(2,), name_map={"0.weight": "w", "0.bias": "b"},
        )
    """

    torch_module: Callable[[], Any]
    jax_apply: Callable[[Mapping[str, Any], Any], Any]
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    name_map: Mapping[str, str] | None = None
    description: str = "user model pair"


def resolve_pair(name: str) -> ModelPair:
    """Import the :class:`ModelPair` named ``"package.module:attribute"``.

    The attribute may be the pair itself or a function of no arguments returning one.

    Raises:
        ValueError: the name is malformed, cannot be imported, or is not a pair.
    """
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"model {name!r}: expected 'package.module:attribute'")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"model {name!r} cannot be imported: {err}") from None
    pair = target() if callable(target) and not isinstance(target, ModelPair) else target
    if not isinstance(pair, ModelPair):
        raise ValueError(f"model {name!r} is a {type(pair).__name__}, not an xgrad ModelPair")
    return pair


def check_name_map(pair: ModelPair, torch_names: Sequence[str]) -> dict[str, str]:
    """The checked torch -> JAX name map of ``pair`` for its torch parameters ``torch_names``.

    Raises:
        ValueError: a torch parameter without a JAX name, a name for no parameter, or two
            parameters mapped to one JAX key (all named).
    """
    mapping = {n: n for n in torch_names} if pair.name_map is None else dict(pair.name_map)
    missing = [n for n in torch_names if n not in mapping]
    extra = [n for n in mapping if n not in torch_names]
    seen: dict[str, str] = {}
    twice = []
    for torch_name, jax_name in mapping.items():
        if jax_name in seen:
            twice.append(f"{seen[jax_name]!r} and {torch_name!r} -> {jax_name!r}")
        seen[jax_name] = torch_name
    if missing or extra or twice:
        raise ValueError(
            f"name map of {pair.description!r} does not match the torch module: parameters "
            f"without a JAX name {missing}, names of no parameter {extra}, shared JAX names {twice}"
        )
    return {n: mapping[n] for n in torch_names}


@functools.lru_cache(maxsize=32)
def pair_spec(name: str) -> ModelSpec:
    """The spec of the pair ``name``: shapes from its torch module (torch is imported here)."""
    pair = resolve_pair(name)
    # Shapes come from the torch module itself; torch is imported only for pairs.
    module = pair.torch_module()
    params = tuple((n, tuple(int(d) for d in p.shape)) for n, p in module.named_parameters())
    check_name_map(pair, [n for n, _ in params])
    return ModelSpec(
        name=name,
        description=pair.description,
        params=params,
        input_shape=tuple(pair.input_shape),
        output_shape=tuple(pair.output_shape),
        init=_fan_in_uniform,
    )
