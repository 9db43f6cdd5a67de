"""Bucketed data-parallel gradients in JAX: pmap and shard_map, plans, hooks, bad input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.extend.core import jaxprs_in_params  # noqa: E402

from xgrad import crosscheck, models  # noqa: E402
from xgrad.buckets import BucketPlan, assign_buckets, ddp_initial_plan  # noqa: E402
from xgrad.jax_backend import models as jm  # noqa: E402
from xgrad.jax_backend.data_parallel import data_parallel_value_and_grad  # noqa: E402
from xgrad.jax_backend.reduce import (  # noqa: E402
    leaf_names,
    plan_for,
    plan_order,
    reduce_gradients,
)

WORLD = 2


def _mlp_case(dtype: str = "float32") -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    w = models.init_weights("mlp", seed=1, dtype=dtype)
    x, y = models.make_batch("mlp", seed=1, batch_size=4 * WORLD, dtype=dtype)
    return w, x, y


def _np(tree: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree.items()}


@pytest.fixture(scope="module")
def mlp_runs() -> dict[tuple[str, bool, str | None], dict[str, np.ndarray]]:
    """MLP gradients for each mode, with and without a plan, for each hook (compiled once)."""
    w, x, y = _mlp_case()
    plan = plan_for(w, names=list(w), bucket_cap_bytes=2048)
    loss = jm.make_loss(jm.mlp)
    out = {}
    for mode in ("pmap", "shard_map"):
        for bucketed in (True, False):
            for hook in (None, "fp16"):
                step = data_parallel_value_and_grad(
                    loss,
                    world_size=WORLD,
                    plan=plan if bucketed else None,
                    names=list(w),
                    hook=hook,
                    mode=mode,
                )
                out[(mode, bucketed, hook)] = _np(step(jm.to_params(w), x, y)[1])
    return out


def test_pmap_shard_map_bucketed_and_leafwise_give_identical_bits(
    mlp_runs: dict[tuple[str, bool, str | None], dict[str, np.ndarray]],
) -> None:
    for hook in (None, "fp16"):
        base = mlp_runs[("shard_map", True, hook)]
        for key, grads in mlp_runs.items():
            if key[2] == hook:
                for name, g in grads.items():
                    assert np.array_equal(g, base[name]), (key, name)


def test_averaged_gradients_equal_the_full_batch_gradient(
    mlp_runs: dict[tuple[str, bool, str | None], dict[str, np.ndarray]],
) -> None:
    from xgrad.torch_backend.models import single_process_grads

    w, x, y = _mlp_case()
    exact = single_process_grads("mlp", w, x, y)
    for name, g in mlp_runs[("shard_map", True, None)].items():
        assert g.dtype == np.float32
        assert np.abs(g - exact[name]).max() <= 1e-6 * np.abs(exact[name]).max()


def test_fp16_hook_is_the_compression_arithmetic(
    mlp_runs: dict[tuple[str, bool, str | None], dict[str, np.ndarray]],
) -> None:
    """Per-device float32 gradients, cast to float16, divided, summed there, cast back."""
    w, x, y = _mlp_case()
    grad = jax.jit(jax.grad(jm.make_loss(jm.mlp)))
    per_rank = [
        _np(grad(jm.to_params(w), models.shard(x, WORLD, r), models.shard(y, WORLD, r)))
        for r in range(WORLD)
    ]
    expected = crosscheck.compression_model(per_rank, "fp16", "float32")
    got = mlp_runs[("pmap", True, "fp16")]
    for name in w:
        assert np.array_equal(got[name], expected[name]), name
    plain = mlp_runs[("pmap", True, None)]
    assert any(not np.array_equal(got[n], plain[n]) for n in w)


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_other_zoo_models_reduce_correctly(name: str) -> None:
    from xgrad.torch_backend.models import single_process_grads

    w = models.init_weights(name, seed=2, dtype="float32")
    x, y = models.make_batch(name, seed=2, batch_size=2 * WORLD, dtype="float32")
    plan = plan_for(w, names=list(w), bucket_cap_bytes=1024)
    assert len(plan.buckets) > 1
    step = data_parallel_value_and_grad(
        jm.make_loss(jm.get_apply(name)), world_size=WORLD, plan=plan, names=list(w)
    )
    loss, grads = step(jm.to_params(w), x, y)
    exact = single_process_grads(name, w, x, y)
    for k in w:
        assert np.abs(np.asarray(grads[k]) - exact[k]).max() <= 1e-6 * np.abs(exact[k]).max(), k
    assert np.isfinite(float(loss))


def _count_psums(jaxpr: Any) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "psum":
            count += 1
        for sub in jaxprs_in_params(eqn.params):
            count += _count_psums(sub)
    return count


def test_one_collective_per_bucket_or_per_leaf() -> None:
    """The effect of bucketing: collectives issued = buckets with a plan, leaves without."""
    w, _, _ = _mlp_case()
    names = list(w)
    plan = plan_for(w, names=names, bucket_cap_bytes=2048)
    grads = jm.to_params(w)

    def body(g: Any, bucketed: bool) -> Any:
        return reduce_gradients(
            g, "i", world_size=WORLD, plan=plan if bucketed else None, names=names
        )

    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a] * WORLD), grads)
    for bucketed, expected in ((True, len(plan.buckets)), (False, len(names))):
        fn = jax.pmap(lambda g, b=bucketed: body(g, b), "i", devices=jax.devices()[:WORLD])
        assert _count_psums(jax.make_jaxpr(fn)(stacked).jaxpr) == expected


def test_plan_order_maps_torch_names_to_sorted_pytree_leaves() -> None:
    tree = {"b": 1.0, "a": {"x": 2.0, "y": [3.0, 4.0]}}
    assert leaf_names(tree) == ["a.x", "a.y.0", "a.y.1", "b"]
    assert plan_order(tree, ["b", "a.y.1", "a.x", "a.y.0"]) == [3, 2, 0, 1]
    assert plan_order(tree, None) == [0, 1, 2, 3]
    with pytest.raises(
        ValueError, match=r"names without a leaf \['c'\].*leaves without a name \['b'\]"
    ):
        plan_order(tree, ["a.x", "a.y.0", "a.y.1", "c"])


def test_plan_for_is_ddps_plan() -> None:
    w, _, _ = _mlp_case()
    nbytes = [a.nbytes for a in w.values()]
    assert plan_for(w, names=list(w)) == ddp_initial_plan(
        nbytes, keys=["float32"] * len(nbytes), find_unused_parameters=True
    )
    assert plan_for(w, names=list(w), bucket_cap_bytes=2048) == crosscheck.bucket_plan(w, 2048)
    keys = ["float32"] * len(nbytes)
    # A small first bucket, then the cap (or DDP's 25 MiB when only the first is given).
    both = plan_for(w, names=list(w), bucket_cap_bytes=4096, first_bucket_cap_bytes=512)
    assert both == assign_buckets(nbytes, [512, 4096], keys=keys).reversed()
    first_only = plan_for(w, names=list(w), first_bucket_cap_bytes=512)
    assert first_only == assign_buckets(nbytes, [512, 25 << 20], keys=keys).reversed()
    with pytest.raises(ValueError, match="bucket_cap_bytes=0"):
        plan_for(w, bucket_cap_bytes=0)


def test_bad_input_is_named() -> None:
    w, x, y = _mlp_case()
    loss = jm.make_loss(jm.mlp)
    with pytest.raises(ValueError, match="mode='vmap'"):
        data_parallel_value_and_grad(loss, world_size=2, mode="vmap")
    with pytest.raises(ValueError, match="hook='fp8'"):
        data_parallel_value_and_grad(loss, world_size=2, hook="fp8")
    with pytest.raises(ValueError, match="world_size=9 needs 9 JAX devices but 8"):
        data_parallel_value_and_grad(loss, world_size=9)
    step = data_parallel_value_and_grad(loss, world_size=3, names=list(w))
    with pytest.raises(ValueError, match=r"batch argument 0 has 2 rows, fewer than 3"):
        step(jm.to_params(w), x[:2], y[:2])
    short = BucketPlan(((0, 1),), (1024,))
    bad = data_parallel_value_and_grad(loss, world_size=2, names=list(w), plan=short)
    with pytest.raises(ValueError, match="plan covers 2 parameters but the gradient pytree has 6"):
        bad(jm.to_params(w), x, y)


def test_a_bucket_never_mixes_dtypes() -> None:
    grads = {"a": jnp.ones((2, 3), jnp.float32), "b": jnp.ones(3, jnp.float16)}
    plan = BucketPlan(((0, 1),), (1 << 20,))
    fn = jax.pmap(
        lambda g: reduce_gradients(g, "i", world_size=2, plan=plan, names=["a", "b"]),
        "i",
        devices=jax.devices()[:2],
    )
    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), grads)
    with pytest.raises(
        ValueError, match=r"bucket 0 of the plan mixes dtypes \['float16', 'float32'\]"
    ):
        fn(stacked)


def test_registered_as_the_jax_backend() -> None:
    from xgrad.backend import backend_available, get_backend

    backend = get_backend("jax")
    assert backend.name == "jax" and backend_available("jax") == (True, "")
    assert backend.data_parallel_value_and_grad is data_parallel_value_and_grad
    with pytest.raises(AttributeError, match="no attribute 'pmap_everything'"):
        backend.pmap_everything  # noqa: B018
