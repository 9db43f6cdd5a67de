"""Bring your own model: a pair found by import path runs through the crosscheck; bad ones are named."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from xgrad import model_pairs, models

torch = pytest.importorskip("torch")


def _tiny_torch() -> Any:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _tiny_jax(p: Mapping[str, Any], x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]


#: a user's pair, found by import path like any user module's.
PAIR = model_pairs.ModelPair(
    torch_module=_tiny_torch,
    jax_apply=_tiny_jax,
    input_shape=(4,),
    output_shape=(2,),
    name_map={"0.weight": "w1", "0.bias": "b1", "2.weight": "w2", "2.bias": "b2"},
    description="tiny user MLP",
)
BAD_PAIR = dataclasses.replace(PAIR, name_map={"0.weight": "w1", "0.bias": "w1", "9.bias": "b"})


def test_a_user_pair_runs_through_the_crosscheck(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    from xgrad import crosscheck

    name = f"{__name__}:PAIR"
    assert models.param_names(name) == ("0.weight", "0.bias", "2.weight", "2.bias")
    report = crosscheck.run_crosscheck(
        crosscheck.Case(model=name, steps=1), backends=["jax-shard_map", "reference"]
    )
    jax_side, reference = report.backends
    assert jax_side.status == "ok" and max(m.rel for m in jax_side.params) <= 1e-6
    assert reference.status == "skipped" and "implements mlp" in reference.reason
    json_path, _ = crosscheck.write_outputs(report, tmp_path)
    assert json_path.name.endswith("_PAIR-ws2-float32-cap2048-nohook.json")
    assert ":" not in json_path.name


def test_a_bad_pair_is_refused_with_names() -> None:
    with pytest.raises(ValueError, match=r"without a JAX name \['2.weight', '2.bias'\]"):
        models.get_spec(f"{__name__}:BAD_PAIR")
    with pytest.raises(ValueError, match=r"names of no parameter \['9.bias'\]"):
        models.get_spec(f"{__name__}:BAD_PAIR")
    with pytest.raises(ValueError, match=r"'0.weight' and '0.bias' -> 'w1'"):
        models.get_spec(f"{__name__}:BAD_PAIR")
    with pytest.raises(ValueError, match="is a float, not an xgrad ModelPair"):
        models.get_spec("math:pi")
    with pytest.raises(ValueError, match="cannot be imported"):
        models.get_spec("xgrad_no_such_module:PAIR")


def test_pair_names_are_still_importable_from_models() -> None:
    assert models.ModelPair is model_pairs.ModelPair
    assert models.resolve_pair is model_pairs.resolve_pair
    assert models.is_pair_name("pkg.mod:PAIR") and not models.is_pair_name("mlp")
