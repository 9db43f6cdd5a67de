"""A batch the devices do not divide: torch's ``tensor_split``, each device counting 1/w.

The reference is written out: the mean of the shards' own mean losses (the first ``n % w``
shards one row longer), in float64, as PyTorch's DDP gives it (the last test runs it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from xgrad import models  # noqa: E402
from xgrad.jax_backend import models as jm  # noqa: E402
from xgrad.jax_backend.data_parallel import data_parallel_value_and_grad  # noqa: E402
from xgrad.jax_backend.reduce import plan_for  # noqa: E402

LOSS = jm.make_loss(jm.mlp)
SIZES = {(10, 4): [3, 3, 2, 2], (5, 4): [2, 1, 1, 1], (7, 3): [3, 2, 2]}


def _case(
    rows: int, dtype: str = "float64"
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    w = models.init_weights("mlp", seed=2, dtype=dtype)
    x, y = models.make_batch("mlp", seed=2, batch_size=rows, dtype=dtype)
    return w, x, y


def _shards(a: np.ndarray, world: int) -> list[np.ndarray]:
    sizes = SIZES[(len(a), world)]
    return np.split(a, np.cumsum(sizes)[:-1])


def _reference(params: Any, x: np.ndarray, y: np.ndarray, world: int) -> tuple[Any, Any]:
    def f(p: Any) -> Any:
        losses = [LOSS(p, a, b) for a, b in zip(_shards(x, world), _shards(y, world), strict=True)]
        return sum(losses) / world

    return jax.value_and_grad(f)(params)


def _max_rel(got: Any, want: Any) -> float:
    return max(
        float(np.max(np.abs(np.asarray(got[k]) - np.asarray(want[k]))) / np.max(np.abs(want[k])))
        for k in want
    )


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
@pytest.mark.parametrize(("rows", "world"), [(10, 4), (5, 4), (7, 3)])
def test_uneven_batch_is_the_mean_of_the_shard_losses(mode: str, rows: int, world: int) -> None:
    w, x, y = _case(rows)
    with jax.enable_x64(True):
        params = jm.to_params(w)
        want_loss, want = _reference(params, x, y, world)
        step = data_parallel_value_and_grad(LOSS, world_size=world, mode=mode)
        loss, grads = step(params, x, y)
        assert abs(float(loss) - float(want_loss)) <= 1e-14 * abs(float(want_loss))
        assert _max_rel(grads, want) <= 1e-13
        if rows == 10:  # the weighting matters: the whole batch's mean is another gradient
            assert _max_rel(grads, jax.grad(LOSS)(params, x, y)) > 1e-3
            # Bucketed, the same numbers (the reduction is untouched by the split).
            names = list(w)
            bucketed = data_parallel_value_and_grad(
                LOSS, world_size=world, mode=mode, names=names, plan=plan_for(w, names=names)
            )
            assert _max_rel(bucketed(params, x, y)[1], want) <= 1e-13


def test_rows_split_as_tensor_split_and_pad_with_a_copy() -> None:
    from xgrad.jax_backend.uneven import Rows

    assert Rows(10, 4).sizes() == [3, 3, 2, 2]
    assert Rows(5, 4).sizes() == [2, 1, 1, 1]
    # Blocks of 3 rows: devices 2 and 3 repeat their last row, never read.
    assert Rows(10, 4).layout().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 9]
    assert str(Rows(10, 4)) == "10 rows over 4 devices (3, 3, 2, 2)"


def _aux_loss(params: Any, batch: dict[str, Any], scale: Any) -> Any:
    out = jm.mlp(params, batch["x"])
    return scale * jnp.mean((out - batch["y"]) ** 2), {"rows": jnp.float32(out.shape[0])}


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_pytrees_whole_arguments_aux_and_an_outer_jit(mode: str) -> None:
    w, x, y = _case(10, "float32")
    params = jm.to_params(w)
    step = data_parallel_value_and_grad(
        _aux_loss, world_size=4, mode=mode, in_axes=(0, None), has_aux=True
    )
    (loss, aux), grads = step(params, {"x": x, "y": y}, jnp.float32(2.0))
    assert aux["rows"].tolist() == [3, 3, 2, 2]  # each device saw its own rows only
    want_loss, want = _reference(params, x, y, 4)
    assert np.allclose(loss, 2 * want_loss, rtol=1e-6)
    assert _max_rel(grads, jax.tree_util.tree_map(lambda g: 2 * g, want)) <= 1e-5

    @jax.jit
    def traced(params: Any, x: Any, y: Any) -> Any:  # jnp arrays padded inside the trace
        return step(params, {"x": x, "y": y}, jnp.float32(2.0))[1]

    assert _max_rel(traced(params, jnp.asarray(x), jnp.asarray(y)), grads) <= 1e-6


def test_an_aux_that_follows_the_rows_is_refused_by_name() -> None:
    w, x, y = _case(10, "float32")

    def per_row(params: Any, x: Any, y: Any) -> Any:
        out = jm.mlp(params, x)
        return jnp.mean((out - y) ** 2), out

    step = data_parallel_value_and_grad(per_row, world_size=4, has_aux=True)
    with pytest.raises(ValueError, match=r"has_aux=True on 10 rows over 4 devices.*on 3 rows"):
        step(jm.to_params(w), x, y)


@pytest.mark.parametrize("mode", ["shard_map", "jit", "pmap"])
def test_fewer_rows_than_devices_names_both(mode: str) -> None:
    w, x, y = _case(3, "float32")
    step = data_parallel_value_and_grad(LOSS, world_size=4, mode=mode)
    with pytest.raises(
        ValueError, match=r"batch argument 0 has 3 rows, fewer than 4 \(world_size=4\)"
    ):
        step(jm.to_params(w), x, y)


def test_what_an_uneven_batch_cannot_be() -> None:
    w, x, y = _case(10, "float32")
    params = jm.to_params(w)
    jit = data_parallel_value_and_grad(LOSS, world_size=4, mode="jit")
    with pytest.raises(ValueError, match=r"mode='jit'.*10 rows over 4 devices.*'shard_map'"):
        jit(params, x, y)
    # Leaves of 10 and 8 rows: one's 3, 3, 2, 2 would not match the other's 2, 2, 2, 2.
    pair = data_parallel_value_and_grad(lambda p, b: LOSS(p, b[0], b[1][:8]), world_size=4)
    with pytest.raises(ValueError, match=r"batch argument 0\[0\] has 10 rows and .*\[1\] 8"):
        pair(params, (x, y[:8]))


def _torch_rank(rank: int, world_size: int, batches: list[Any]) -> list[Any]:
    """PyTorch's DDP on the rank's ``tensor_split`` share of each batch, float64."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from xgrad.torch_backend.models import build, loss, to_numpy

    out = []
    for w, x, y in batches:
        module = build("mlp", w)
        ddp = DistributedDataParallel(module)
        xs = torch.tensor_split(torch.from_numpy(x), world_size)[rank]
        ys = torch.tensor_split(torch.from_numpy(y), world_size)[rank]
        loss(ddp(xs), ys).backward()
        out.append({n: to_numpy(p.grad) for n, p in module.named_parameters()})
    return out


def test_pytorchs_ddp_on_tensor_split_shards_agrees() -> None:
    """The same 10 and 5 rows under PyTorch's DDP on 4 gloo ranks (one spawn)."""
    pytest.importorskip("torch")
    from xgrad.torch_backend.spawn import spawn

    batches = [_case(10), _case(5)]
    torch_grads = spawn(_torch_rank, 4, args=(batches,), timeout=90)[0]
    with jax.enable_x64(True):
        for (w, x, y), theirs in zip(batches, torch_grads, strict=True):
            step = data_parallel_value_and_grad(LOSS, world_size=4)
            ours = step(jm.to_params(w), x, y)[1]
            assert _max_rel(ours, theirs) <= 1e-13, len(x)
