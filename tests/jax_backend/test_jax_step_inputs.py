"""The data-parallel step as a new user meets it: odd pytrees, dtypes, state and bad input.

Every mode's gradients on nested parameters (dicts, lists, tuples, None, a scalar, a
zero-size leaf) in half, single and double precision equal ``jax.value_and_grad`` of the
whole batch's mean loss; a batch-norm-like running state rides through ``has_aux``. What
does not fit is refused by name: split leaves of different lengths (which paired rows of
one with other rows of the other and returned a number), a PowerSGD state made for another
step (which ran on, or failed deep in the trace), an axis name that is not a string. One
step serves several batch sizes, jitted whole or not.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from xgrad.jax_backend import PowerSGD, plan_for  # noqa: E402
from xgrad.jax_backend.data_parallel import MODES, data_parallel_value_and_grad  # noqa: E402

WORLD = 2


def _params(dtype: Any, rng: np.random.Generator) -> dict[str, Any]:
    def draw(*shape: int) -> Any:
        return jnp.asarray(rng.normal(size=shape), dtype)

    return {
        "enc": [{"w": draw(3, 4), "b": None}, (draw(4),)],
        "head": {"w": draw(4, 2), "s": draw(), "z": jnp.zeros((0, 3), dtype)},
    }


def _loss(p: Any, x: Any, y: Any) -> Any:
    h = jnp.tanh(x.astype(p["enc"][0]["w"].dtype) @ p["enc"][0]["w"] + p["enc"][1][0])
    out = h @ p["head"]["w"] * p["head"]["s"] + jnp.sum(p["head"]["z"])
    return jnp.mean((out - y.astype(out.dtype)) ** 2)


def _max_rel(got: Any, want: Any) -> float:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    worst = 0.0
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        if w.size:
            scale = max(float(np.max(np.abs(np.asarray(w, np.float64)))), 1e-30)
            err = np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)))
            worst = max(worst, float(err) / scale)
    return worst


CASES = [("bfloat16", 2e-2), ("float16", 4e-3), ("float32", 1e-5), ("float64", 1e-12)]
HOOKS: list[Any] = [None, "fp16", "bf16"]
CAPS: list[Any] = [None, 16, 1 << 20]


def _hooks_and_caps(case: int) -> list[tuple[Any, Any]]:
    """The (hook, bucket cap) pairs a bucketing mode runs in dtype case ``case``: each hook
    once and each cap once, the caps shifted by one per case (a Latin square), so that the
    first three dtypes together run all nine pairs and every dtype meets every hook and
    every cap. No code branches on a (dtype, hook, cap) triple: the plan only groups the
    leaves (one collective per bucket, the same per-element arithmetic), the hook casts
    each bucket to its dtype and back; each compiled step costs most of this test's time."""
    return [(hook, CAPS[(case + j) % len(CAPS)]) for j, hook in enumerate(HOOKS)]


@pytest.mark.parametrize(("dtype", "tol"), CASES)
def test_nested_params_in_every_dtype_match_the_whole_batch(dtype: str, tol: float) -> None:
    case = [d for d, _ in CASES].index(dtype)
    with jax.enable_x64(dtype == "float64"):
        rng = np.random.default_rng(0)
        params = _params(dtype, rng)
        x = jnp.asarray(rng.integers(-2, 3, size=(8, 3)), jnp.int32)  # an integer leaf
        y = jnp.asarray(rng.normal(size=(8, 2)), dtype)
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        for mode in MODES:
            pairs = [(None, None)] if mode == "jit" else _hooks_and_caps(case)
            for hook, cap in pairs:
                plan = None if cap is None else plan_for(params, bucket_cap_bytes=cap)
                step = data_parallel_value_and_grad(
                    _loss, world_size=WORLD, mode=mode, hook=hook, plan=plan
                )
                value, got = step(params, x, y)
                where = (mode, hook, cap)
                # a compressing hook rounds the gradients to its own dtype first
                bound = tol if hook is None else max(tol, 5e-2 if hook == "bf16" else 5e-3)
                assert _max_rel(got, grads) <= bound, where
                assert abs(float(value) - float(loss)) <= 10 * tol * abs(float(loss)), where


def test_the_dtype_cases_run_every_hook_with_every_cap() -> None:
    pairs = {pair for case in range(len(CASES)) for pair in _hooks_and_caps(case)}
    assert pairs == {(hook, cap) for hook in HOOKS for cap in CAPS}
    for case in range(len(CASES)):
        hooks, caps = zip(*_hooks_and_caps(case), strict=True)
        assert sorted(map(str, hooks)) == sorted(map(str, HOOKS))
        assert sorted(map(str, caps)) == sorted(map(str, CAPS))


def _bn_loss(p: Any, state: Any, x: Any, y: Any) -> Any:
    """Normalises by a running mean it also updates, as batch norm's buffers go."""
    mean = 0.9 * state["mean"] + 0.1 * jnp.mean(x, 0)
    out = (x - state["mean"]) @ p["w"]
    new = {"mean": mean, "count": state["count"] + 1}
    return jnp.mean((out - y) ** 2), (new, {"out": out, "sum": (out.sum(),)})


@pytest.mark.parametrize("mode", MODES)
def test_a_running_state_rides_through_has_aux(mode: str) -> None:
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}
    state = {"mean": jnp.zeros(3), "count": jnp.asarray(0)}
    x = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)
    step = data_parallel_value_and_grad(
        _bn_loss, world_size=WORLD, mode=mode, has_aux=True, in_axes=(None, 0, 0)
    )
    (loss, (new, aux)), grads = step(params, state, x, y)
    (want, (whole, _)), expected = jax.value_and_grad(_bn_loss, has_aux=True)(params, state, x, y)
    assert _max_rel(grads, expected) <= 1e-6
    assert np.isclose(loss, want, rtol=1e-6)
    if mode == "jit":  # the global batch's state
        assert np.allclose(new["mean"], whole["mean"], atol=1e-7)
    else:  # one row per device: their mean is the whole batch's update
        assert new["mean"].shape == (WORLD, 3) and aux["sum"][0].shape == (WORLD,)
        assert np.allclose(np.mean(new["mean"], 0), whole["mean"], atol=1e-7)
        assert [int(c) for c in new["count"]] == [1] * WORLD


def _broadcasting_loss(p: Any, x: Any, y: Any) -> Any:
    return jnp.mean((x @ p["w"] - y) ** 2)


@pytest.mark.parametrize("mode", MODES)
def test_split_leaves_of_different_rows_are_refused(mode: str) -> None:
    """8 rows of ``x`` and 2 of ``y`` over 2 devices: each device paired 4 rows of ``x``
    with 1 of ``y``, which the loss broadcast, and the step returned a number where the
    whole batch's loss refuses (``(8, 2) - (2, 2)``)."""
    params = {"w": jnp.ones((3, 2))}
    x, y = jnp.ones((8, 3)), jnp.zeros((2, 2))
    step = data_parallel_value_and_grad(_broadcasting_loss, world_size=WORLD, mode=mode)
    with pytest.raises(ValueError, match=r"batch argument 0 has 8 rows and batch argument 1 2"):
        step(params, x, y)
    pytree = data_parallel_value_and_grad(
        lambda p, b: _broadcasting_loss(p, b["x"], b["y"]), world_size=WORLD, mode=mode
    )
    with pytest.raises(ValueError, match=r"\['x'\] has 8 rows and batch argument 0\['y'\] 4"):
        pytree(params, {"x": x, "y": jnp.zeros((4, 2))})
    # Given whole (in_axes None), a leaf of another length is fine.
    whole = data_parallel_value_and_grad(
        _broadcasting_loss, world_size=WORLD, mode=mode, in_axes=(0, None)
    )
    loss, _ = whole(params, x, jnp.zeros((1, 2)))
    assert np.isclose(loss, 9.0)


def _psgd_case() -> tuple[dict[str, Any], Any, Any]:
    rng = np.random.default_rng(2)
    params = {
        "a": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    return params, x, jnp.zeros((8, 16), jnp.float32)


def _mlp(p: Any, x: Any, y: Any) -> Any:
    return jnp.mean((jnp.tanh(x @ p["a"]) @ p["b"] - y) ** 2)


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_a_powersgd_state_made_for_another_step_is_refused(mode: str) -> None:
    params, x, y = _psgd_case()

    def step(**kw: Any) -> Any:
        opts: dict[str, Any] = {"world_size": WORLD, "mode": mode, "hook": "powersgd"}
        return data_parallel_value_and_grad(_mlp, **{**opts, **kw})

    ours = step()
    state = ours.init(params)
    for _ in range(3):  # its own state, carried, fits
        _, _, state = ours(params, x, y, hook_state=state)
    assert int(state.iter) == 3
    # Another world size: shard_map took rows 0 and 2 of its 4 error rows and ran on.
    with pytest.raises(ValueError, match=r"errors\[0\] has shape \(4, 256\).*needs \(2, 256\)"):
        ours(params, x, y, hook_state=step(world_size=4).init(params))
    # Another rank: "cond branches must have equal output types" from deep in JAX.
    ranked = step(hook=PowerSGD(matrix_approximation_rank=2)).init(params)
    with pytest.raises(ValueError, match=r"qs\[0\] has shape \(32,\).*needs \(16,\).*rank=1"):
        ours(params, x, y, hook_state=ranked)
    # Another plan: "add got incompatible shapes", no bucket named.
    bucketed = step(plan=plan_for(params)).init(params)  # one bucket; ours has one per leaf
    with pytest.raises(ValueError, match=r"errors has 1 entries but this step has 2"):
        ours(params, x, y, hook_state=bucketed)
    with pytest.raises(TypeError, match=r"hook_state=dict: expected the PowerSGDCarry"):
        ours(params, x, y, hook_state={"iter": 0})
    with pytest.raises(ValueError, match=r"keeps state: call step"):
        ours(params, x, y)


def test_the_axis_name_is_a_string() -> None:
    with pytest.raises(TypeError, match=r"axis_name=3: expected a non-empty str"):
        data_parallel_value_and_grad(_mlp, world_size=WORLD, axis_name=3)  # type: ignore[arg-type]


def test_one_step_serves_several_batch_sizes_plain_and_jitted() -> None:
    params, x, y = _psgd_case()
    step = data_parallel_value_and_grad(_mlp, world_size=WORLD)
    jitted = jax.jit(step)
    for rows in (8, 4, 6, 2):
        want = jax.value_and_grad(_mlp)(params, x[:rows], y[:rows])
        for got in (step(params, x[:rows], y[:rows]), jitted(params, x[:rows], y[:rows])):
            assert np.isclose(got[0], want[0], rtol=1e-6), rows
            assert _max_rel(got[1], want[1]) <= 1e-5, rows
