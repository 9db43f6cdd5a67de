"""Graph, engine, buckets and reducer end to end on simulated ranks, against one process."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from xgrad import models
from xgrad.buckets import assign_buckets
from xgrad.reference import (
    DataParallel,
    RankError,
    ReferenceComm,
    build_model,
    mlp_batch,
    mlp_weights,
    run_data_parallel,
    single_process_grads,
    spawn,
)

SIZES = [6, 10, 10, 3]
WORLD_SIZES = list(range(1, 9))


def weights(unused: bool = False, dtype: str = "float64") -> dict[str, np.ndarray]:
    extra = [("extra.weight", (4, 5)), ("extra.bias", (4,))] if unused else []
    return mlp_weights(SIZES, seed=7, dtype=dtype, unused=extra)


def assert_grads_equal(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol: float = 1e-12
) -> None:
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=rtol, err_msg=name)


def shard(a: np.ndarray, n: int, r: int) -> np.ndarray:
    per = a.shape[0] // n
    return a[r * per : (r + 1) * per]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_data_parallel_matches_single_process(world_size: int) -> None:
    w = weights()
    x, y = mlp_batch(SIZES, 3 * world_size, seed=world_size)
    ref = single_process_grads(w, x, y)
    # A 200-byte cap makes several buckets; the second step runs on rebuilt buckets.
    got = run_data_parallel(w, x, y, world_size=world_size, bucket_cap_bytes=200, steps=2)
    assert_grads_equal(got, ref)


def ignored_output_run(
    comm: ReferenceComm, w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, model: str
) -> list[dict[str, np.ndarray]]:
    """PyTorch's test_ignored_output: 4 forwards whose output is dropped, then 4 with backward."""
    dp = DataParallel(
        build_model(model, w),
        comm,
        find_unused_parameters=model == "mlp_unused",
        bucket_cap_bytes=300,
    )
    xs, ys = shard(x, comm.size, comm.rank), shard(y, comm.size, comm.rank)
    for _ in range(4):
        output = dp.forward(xs, ys)
        del output
    grads = []
    for _ in range(4):
        dp.backward(dp.forward(xs, ys))  # no zero_grad, as in PyTorch's test: grads accumulate
        grads.append(dp.grads())
    return grads


@pytest.mark.parametrize("model", ["mlp", "mlp_unused"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ignored_output(world_size: int, model: str) -> None:
    w = weights(unused=model == "mlp_unused")
    x, y = mlp_batch(SIZES, 2 * world_size, seed=1)
    ref = single_process_grads(w, x, y, model=model)
    assert "extra.weight" not in ref
    per_rank = spawn(lambda comm: ignored_output_run(comm, w, x, y, model), world_size)
    for grads in per_rank:
        for k, g in enumerate(grads, start=1):
            assert_grads_equal(g, {n: k * v for n, v in ref.items()})


@pytest.mark.parametrize("world_size", [1, 3])
def test_no_sync_accumulates_locally_then_reduces_everything(world_size: int) -> None:
    w = weights()
    xa, ya = mlp_batch(SIZES, 2 * world_size, seed=2)
    xb, yb = mlp_batch(SIZES, 2 * world_size, seed=3)
    ref_a = single_process_grads(w, xa, ya)
    ref_b = single_process_grads(w, xb, yb)

    def body(comm: ReferenceComm) -> tuple[dict[str, Any], dict[str, Any], int]:
        dp = DataParallel(build_model("mlp", w), comm, bucket_cap_bytes=200)
        r, n = comm.rank, comm.size
        with dp.no_sync():
            dp.backward(dp.forward(shard(xa, n, r), shard(ya, n, r)))
        local = dp.grads()
        launched = comm.world._seq[r]
        dp.backward(dp.forward(shard(xb, n, r), shard(yb, n, r)))
        return local, dp.grads(), launched

    for r, (local, synced, launched) in enumerate(spawn(body, world_size)):
        assert launched == 0  # nothing was communicated under no_sync
        local_ref = single_process_grads(w, shard(xa, world_size, r), shard(ya, world_size, r))
        assert_grads_equal(local, local_ref)
        assert_grads_equal(synced, {n: ref_a[n] + ref_b[n] for n in ref_a})


@pytest.mark.parametrize("model", ["mlp", "mlp_unused"])
def test_static_graph(model: str) -> None:
    w = weights(unused=model == "mlp_unused")
    x, y = mlp_batch(SIZES, 8, seed=4)
    ref = single_process_grads(w, x, y, model=model)

    def body(comm: ReferenceComm) -> list[dict[str, Any]]:
        dp = DataParallel(build_model(model, w), comm, static_graph=True, bucket_cap_bytes=250)
        out = []
        for _ in range(3):
            dp.zero_grad()
            dp.backward(dp.forward(shard(x, 4, comm.rank), shard(y, 4, comm.rank)))
            out.append(dp.grads())
        assert dp.reducer.has_rebuilt_buckets
        return out

    for per_iteration in spawn(body, 4):
        for grads in per_iteration:
            assert_grads_equal(grads, ref)


def test_gradient_as_bucket_view() -> None:
    w = weights()
    x, y = mlp_batch(SIZES, 6, seed=5)
    ref = single_process_grads(w, x, y)

    def body(comm: ReferenceComm) -> None:
        dp = DataParallel(
            build_model("mlp", w), comm, gradient_as_bucket_view=True, bucket_cap_bytes=200
        )
        for _ in range(2):
            dp.zero_grad()
            dp.backward(dp.forward(shard(x, 3, comm.rank), shard(y, 3, comm.rank)))
            assert_grads_equal(dp.grads(), ref)
        views = dp.reducer.bucket_views()
        assert all(np.shares_memory(dp.engine.grads[i], views[i]) for i in range(len(views)))

    spawn(body, 3)


def test_explicit_plan_is_kept_and_hooks_reduce() -> None:
    w = weights(dtype="float32")
    x, y = mlp_batch(SIZES, 8, seed=6, dtype="float32")
    ref = single_process_grads(w, x, y)
    plan = assign_buckets([a.nbytes for a in w.values()], [300]).reversed()
    got = run_data_parallel(w, x, y, world_size=4, plan=plan, hook="allreduce", steps=2)
    assert_grads_equal(got, ref, rtol=1e-5)
    half = run_data_parallel(w, x, y, world_size=4, plan=plan, hook="fp16")
    assert_grads_equal(half, ref, rtol=2e-3)

    def body(comm: ReferenceComm) -> Any:
        dp = DataParallel(build_model("mlp", w), comm, plan=plan)
        for _ in range(2):
            dp.backward(dp.forward(shard(x, 2, comm.rank), shard(y, 2, comm.rank)))
        return dp.reducer.plan

    assert spawn(body, 2) == [plan, plan]


def test_unused_parameter_without_detection_names_parameter_and_rank() -> None:
    w = weights(unused=True)
    x, y = mlp_batch(SIZES, 4, seed=0)
    with pytest.raises(RankError, match=r"(?s)rank 0 .*extra\.weight, extra\.bias"):
        run_data_parallel(w, x, y, world_size=2, model="mlp_unused", find_unused_parameters=False)


def test_model_names_are_checked() -> None:
    with pytest.raises(ValueError, match=r"model='mlp' uses every parameter but \['extra.weight'"):
        run_data_parallel(weights(unused=True), *mlp_batch(SIZES, 2), world_size=1)
    with pytest.raises(ValueError, match="model='cnn' is not a reference model"):
        single_process_grads(weights(), *mlp_batch(SIZES, 2), model="cnn")
    with pytest.raises(ValueError, match="batch size 5 does not split evenly over world_size=2"):
        run_data_parallel(weights(), *mlp_batch(SIZES, 5), world_size=2)


def test_matches_the_model_zoo_convention() -> None:
    w = models.init_weights("mlp", seed=0, dtype="float64")
    x, y = models.make_batch("mlp", seed=0, batch_size=8, dtype="float64")
    got = run_data_parallel(w, x, y, world_size=4, bucket_cap_bytes=1024)
    assert_grads_equal(got, single_process_grads(w, x, y))
