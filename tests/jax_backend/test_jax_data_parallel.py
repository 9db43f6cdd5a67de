"""The data-parallel step: shard_map, jit and pmap; in_axes, pytree batches, has_aux."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from xgrad import models  # noqa: E402
from xgrad.jax_backend import models as jm  # noqa: E402
from xgrad.jax_backend.data_parallel import MODES, data_parallel_value_and_grad  # noqa: E402

WORLD = 2


def _case() -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    w = models.init_weights("mlp", seed=1, dtype="float32")
    x, y = models.make_batch("mlp", seed=1, batch_size=4 * WORLD, dtype="float32")
    return jm.to_params(w), x, y


def test_modes_agree_and_shard_map_leads() -> None:
    params, x, y = _case()
    assert MODES[0] == "shard_map"
    loss = jm.make_loss(jm.mlp)
    full = jax.value_and_grad(loss)(params, x, y)
    for mode in MODES:
        value, grads = data_parallel_value_and_grad(loss, world_size=WORLD, mode=mode)(params, x, y)
        assert np.allclose(value, full[0], rtol=1e-6)
        for k in params:
            assert np.allclose(grads[k], full[1][k], rtol=1e-5, atol=1e-7), (mode, k)


def _dict_loss(params: Any, batch: dict[str, Any], key: Any, opts: dict[str, Any]) -> Any:
    """A loss with a dict batch, an RNG key and a dict of options given whole to every device."""
    keep = jax.random.bernoulli(key, 0.5, batch["x"].shape[1:])  # same mask on every device
    out = jm.mlp(params, batch["x"] * keep)
    return opts["scale"] * jnp.mean((out - batch["y"]) ** 2), {"out": out}


@pytest.mark.parametrize("mode", MODES)
def test_in_axes_pytree_batches_and_has_aux(mode: str) -> None:
    params, x, y = _case()
    key = jax.random.PRNGKey(0)
    opts = {"scale": jnp.float32(2.0)}
    step = data_parallel_value_and_grad(
        _dict_loss, world_size=WORLD, mode=mode, in_axes=(0, None, None), has_aux=True
    )
    (loss, aux), grads = step(params, {"x": x, "y": y}, key, opts)
    (full, _), expected = jax.value_and_grad(_dict_loss, has_aux=True)(
        params, {"x": x, "y": y}, key, opts
    )
    assert np.allclose(loss, full, rtol=1e-6)
    for k in params:
        assert np.allclose(grads[k], expected[k], rtol=1e-5, atol=1e-7), k
    if mode == "jit":  # XLA's step sees the global batch: aux is the global one
        assert aux["out"].shape == (4 * WORLD, 8)
    else:  # every device's aux, stacked on a leading axis, as pmap returns it
        assert aux["out"].shape == (WORLD, 4, 8)
    # pmap's spelling of in_axes (params first, always replicated) is accepted too.
    again = data_parallel_value_and_grad(
        _dict_loss, world_size=WORLD, mode=mode, in_axes=(None, 0, None, None), has_aux=True
    )
    assert np.allclose(again(params, {"x": x, "y": y}, key, opts)[0][0], loss)


def test_the_step_can_be_jitted_whole() -> None:
    params, x, y = _case()
    step = data_parallel_value_and_grad(jm.make_loss(jm.mlp), world_size=WORLD)

    @jax.jit
    def train(params: Any, x: Any, y: Any) -> Any:
        loss, grads = step(params, x, y)
        return loss, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    loss, new = train(params, x, y)
    ref_loss, ref_grads = step(params, x, y)
    assert np.allclose(loss, ref_loss)
    for k in params:
        assert np.allclose(new[k], params[k] - 0.1 * ref_grads[k], rtol=1e-6, atol=1e-7)


def test_bad_input_is_named() -> None:
    params, x, y = _case()
    loss = jm.make_loss(jm.mlp)
    with pytest.raises(ValueError, match="mode='vmap'"):
        data_parallel_value_and_grad(loss, world_size=2, mode="vmap")
    with pytest.raises(ValueError, match="hook='fp8'"):
        data_parallel_value_and_grad(loss, world_size=2, hook="fp8")
    with pytest.raises(TypeError, match="hook=3"):
        data_parallel_value_and_grad(loss, world_size=2, hook=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size=9 needs 9 JAX devices but 8"):
        data_parallel_value_and_grad(loss, world_size=9)
    with pytest.raises(ValueError, match="mode='jit' lets XLA"):
        data_parallel_value_and_grad(loss, world_size=2, mode="jit", hook="fp16")
    with pytest.raises(TypeError, match="loss_fn=3 is not callable"):
        data_parallel_value_and_grad(3, world_size=2)  # type: ignore[arg-type]
    step = data_parallel_value_and_grad(loss, world_size=3, mode="jit")
    with pytest.raises(ValueError, match=r"mode='jit'.*8 rows over 3 devices \(3, 3, 2\)"):
        step(params, x, y)
    step = data_parallel_value_and_grad(_dict_loss, world_size=2, has_aux=True)
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match=r"batch argument 2\['scale'\] is a scalar.*in_axes None"):
        step(params, {"x": x, "y": y}, key, {"scale": 2.0})
    with pytest.raises(ValueError, match=r"batch argument 0 is an empty pytree"):
        step(params, {}, key, {"scale": jnp.ones(2)})
    typed = data_parallel_value_and_grad(loss, world_size=2, in_axes=0)
    with pytest.raises(ValueError, match=r"batch argument 1 is a PRNG key"):
        typed(params, x, jax.random.key(0))
    with pytest.raises(ValueError, match=r"in_axes=\(0, None\) has 2 entries for 3"):
        data_parallel_value_and_grad(_dict_loss, world_size=2, in_axes=(0, None))(
            params, {"x": x, "y": y}, key, {}
        )
    with pytest.raises(ValueError, match=r"in_axes\[0\]=1: only 0"):
        data_parallel_value_and_grad(loss, world_size=2, in_axes=1)(params, x, y)
    with pytest.raises(ValueError, match="keeps no state; drop hook_state"):
        data_parallel_value_and_grad(loss, world_size=2)(params, x, y, hook_state=())


def test_package_lists_its_functions() -> None:
    import xgrad.jax_backend as jb

    names = dir(jb)
    for name in ("data_parallel_value_and_grad", "plan_for", "reduce_gradients", "PowerSGD"):
        assert name in names
