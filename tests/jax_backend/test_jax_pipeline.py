"""JAX pipeline on several CPU devices: gradients equal the whole model and the torch pipeline."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import xgrad.pipeline as xp

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

WIDTH, BATCH = 5, 24


def block(params: dict[str, Any], x: Any) -> Any:
    return jnp.tanh(x @ params["weight"].T + params["bias"])


def mse(out: Any, y: Any) -> Any:
    return jnp.mean((out - y) ** 2)


def weights(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "weight": rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.5,
            "bias": rng.standard_normal(WIDTH).astype(np.float32) * 0.1,
        }
        for _ in range(n)
    ]


def data(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((BATCH, WIDTH)).astype(np.float32),
        rng.standard_normal((BATCH, WIDTH)).astype(np.float32),
    )


def whole(params: list[Any], order: list[int], x: Any, y: Any) -> tuple[Any, list[Any]]:
    def f(ps: list[Any]) -> Any:
        out = x
        for i in order:
            out = block(ps[i], out)
        return mse(out, y)

    return jax.value_and_grad(f)(params)


def rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def max_err(got: list[Any], want: list[Any]) -> float:
    return max(
        rel(g, w)
        for gp, wp in zip(got, want, strict=True)
        for g, w in zip(jax.tree_util.tree_leaves(gp), jax.tree_util.tree_leaves(wp), strict=True)
    )


@pytest.mark.parametrize("name", sorted(xp.SCHEDULES))
@pytest.mark.parametrize("p", [2, 4])
def test_schedule_matches_whole_model(name: str, p: int) -> None:
    s = xp.make(name, p, 2 * p if p == 2 or name == "dualpipev" else 4, chunks=2)
    n = s.num_stages
    params = weights(n)
    x, y = data()
    loss, grads = xp_run(s, params, x, y)
    want_loss, want = whole(params, list(range(n)), x, y)
    assert abs(float(loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
    assert max_err(grads, want) <= 1e-6
    devices = jax.devices()
    for k in range(n):
        leaf = jax.tree_util.tree_leaves(grads[k])[0]
        assert leaf.devices() == {devices[s.placement[k]]}


def xp_run(s: xp.Schedule, params: list[Any], x: Any, y: Any, **kw: Any) -> tuple[Any, list[Any]]:
    from xgrad.jax_backend.pipeline import pipeline_value_and_grad

    n = len(params)
    return pipeline_value_and_grad(
        s, [block] * n, params, mse, jnp.asarray(x), jnp.asarray(y), **kw
    )


def test_a_summed_loss_with_scale_grads_false_matches_the_whole_model() -> None:
    """``scale_grads=False`` (torch's name) for a loss that sums over its batch."""
    from xgrad.jax_backend.pipeline import pipeline_value_and_grad

    def sse(out: Any, y: Any) -> Any:
        return jnp.sum((out - y) ** 2)

    s = xp.make("1f1b", 2, 4)
    params = weights(2)
    x, y = data()
    loss, grads = pipeline_value_and_grad(
        s, [block] * 2, params, sse, jnp.asarray(x), jnp.asarray(y), scale_grads=False
    )
    want_loss, want = jax.value_and_grad(lambda ps: sse(block(ps[1], block(ps[0], x)), y))(params)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert max_err(grads, want) <= 1e-6
    with pytest.raises(TypeError, match="scale_grads=1 must be a bool"):
        pipeline_value_and_grad(s, [block] * 2, params, sse, x, y, scale_grads=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["gpipe", "1f1b", "zb"])
def test_reused_partition(policy: str) -> None:
    inv = xp.chain([(0, 0), (1, 0), (0, 0)])
    s = xp.from_invocations(inv, 4, policy)
    params = weights(2)
    x, y = data()
    loss, grads = xp_run(s, params, x, y, invocations=inv)
    want_loss, want = whole(params, [0, 1, 0], x, y)
    assert abs(float(loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
    assert max_err(grads, want) <= 1e-6


def per_microbatch(params: list[Any], x: Any, y: Any, m: int) -> tuple[Any, list[Any]]:
    """The reference for an uneven batch, written out: torch's ``tensor_split`` sizes (the
    first ``batch % m`` microbatches one row more), each microbatch's mean loss over its
    own rows counting 1/m."""
    q, extra = divmod(len(x), m)
    ends = np.cumsum([q + (k < extra) for k in range(m)])

    def f(ps: list[Any]) -> Any:
        total = 0.0
        for start, end in zip([0, *ends[:-1]], ends, strict=True):
            out = x[start:end]
            for prm in ps:
                out = block(prm, out)
            total = total + mse(out, y[start:end]) / m
        return total

    return jax.jit(jax.value_and_grad(f))(params)  # jitted: a third of the time eagerly


@pytest.mark.parametrize(
    ("name", "m", "batch"),
    # Microbatches of 3 and 2 rows throughout: the ops compiled for one case serve the rest.
    [("gpipe", 4, 10), ("1f1b", 3, 7), ("zbv", 4, 10), ("dualpipev", 4, 10)],
)
def test_uneven_batch_counts_each_microbatch_one_mth(name: str, m: int, batch: int) -> None:
    """10 rows into 4 microbatches are 3, 3, 2, 2 (as the torch runtime splits them), and
    each microbatch's loss counts 1/m whatever its rows: not the whole batch's mean."""
    s = xp.make(name, 2, m)
    params = weights(s.num_stages)
    x, y = (a[:batch] for a in data())
    loss, grads = xp_run(s, params, x, y)
    want_loss, want = per_microbatch(params, x, y, m)
    assert abs(float(loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
    assert max_err(grads, want) <= 1e-6
    if name == "gpipe":  # the weighting matters: the whole batch's mean is another gradient
        _, other = jax.jit(lambda ps: whole(ps, [0, 1], x, y))(params)
        assert max_err(grads, other) > 1e-3


def test_bad_inputs() -> None:
    from xgrad.jax_backend.pipeline import pipeline_value_and_grad

    s = xp.one_f_one_b(2, 4)
    x, y = data()
    # Fewer rows than microbatches: an empty microbatch (torch's schedules refuse it too).
    with pytest.raises(ValueError, match="inputs batch size 3 is smaller than the 4 microbatches"):
        xp_run(s, weights(2), x[:3], y[:3])
    with pytest.raises(ValueError, match="partitions"):
        xp_run(s, weights(1), x, y)
    # One too many: it would have been left out of the model (a bare KeyError before).
    with pytest.raises(ValueError, match="the schedule runs 2 partitions, got 3 partitions"):
        xp_run(s, weights(3), x, y)
    # Targets of another batch size were broadcast against the outputs, silently.
    with pytest.raises(ValueError, match="targets have batch size 12, the inputs 24"):
        xp_run(s, weights(2), x, y[:12])
    with pytest.raises(ValueError, match="inputs need a batch axis"):
        xp_run(s, weights(2), x[0, 0], y)
    with pytest.raises(TypeError, match=r"schedule must be an xgrad\.pipeline\.Schedule"):
        xp_run("1f1b", weights(2), x, y)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar, got shape \(6, 5\)"):
        pipeline_value_and_grad(
            s, [block] * 2, weights(2), lambda o, t: (o - t) ** 2, jnp.asarray(x), jnp.asarray(y)
        )


def test_pytree_and_integer_inputs_and_targets() -> None:
    """Inputs and targets as pytrees, token ids into an embedding stage, float32 data with
    float64 parameters: what the whole model takes (the cotangent has the loss's dtype)."""
    from xgrad.jax_backend.pipeline import pipeline_value_and_grad

    rng = np.random.default_rng(3)
    table = {"table": rng.standard_normal((11, WIDTH))}
    params = [table, weights(1)[0]]
    ids = rng.integers(0, 11, BATCH).astype(np.int32)
    _, y = data()
    inputs = {"ids": jnp.asarray(ids), "scale": jnp.full((BATCH, 1), 0.5, dtype=jnp.float32)}
    targets = (jnp.asarray(y), jnp.asarray(y) * 0)

    def embed(prm: Any, x: Any) -> Any:
        return prm["table"][x["ids"]] * x["scale"]

    def loss(out: Any, t: Any) -> Any:
        return mse(out, t[0]) + jnp.mean(t[1])

    def f(ps: list[Any]) -> Any:
        return loss(block(ps[1], embed(ps[0], inputs)), targets)

    want_loss, want = jax.value_and_grad(f)(params)
    got_loss, got = pipeline_value_and_grad(
        xp.one_f_one_b(2, 4), [embed, block], params, loss, inputs, targets
    )
    assert abs(float(got_loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
    assert max_err(got, want) <= 1e-6


def test_dag_invocations_with_a_chain_schedule_are_refused() -> None:
    """The DAG's skip connection used to be dropped: run as a chain, silently wrong."""
    locations = [(0, 0), (1, 0), (0, 1)]
    inv = xp.dag(locations, [(), (0,), (1, 0)])
    plain = xp.from_invocations(xp.chain(locations), 4, "1f1b")  # same placement, a chain
    with pytest.raises(ValueError, match=r"invocations form a DAG .* JAX runtime runs chains"):
        xp_run(plain, weights(3), *data(), invocations=inv)


def _torch_pipeline(
    rank: int, world: int, params: list[Any], x: Any, y: Any, sizes: list[int]
) -> list[list[Any]]:
    """This rank's gradients after one step on the first ``size`` rows, for each size."""
    import torch
    from torch import nn

    from xgrad.torch_backend.pipeline import PipelineRuntime

    lin = nn.Linear(WIDTH, WIDTH)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(params[rank]["weight"]))
        lin.bias.copy_(torch.from_numpy(params[rank]["bias"]))
    rt = PipelineRuntime(
        xp.one_f_one_b(world, 4), [nn.Sequential(lin, nn.Tanh())], nn.functional.mse_loss
    )
    found = []
    for size in sizes:
        lin.zero_grad(set_to_none=True)
        rt.step(
            torch.from_numpy(x[:size]) if rank == 0 else None,
            torch.from_numpy(y[:size]) if rank == world - 1 else None,
        )
        assert lin.weight.grad is not None and lin.bias.grad is not None
        found.append([lin.weight.grad.numpy().copy(), lin.bias.grad.numpy().copy()])
    return found


def test_matches_torch_pipeline_on_same_weights() -> None:
    from xgrad.torch_backend.spawn import spawn

    params = weights(2)
    x, y = data()
    sizes = [BATCH, 10]  # even, then uneven: 3, 3, 2, 2 rows in both runtimes
    torch_grads = spawn(_torch_pipeline, 2, args=(params, x, y, sizes), timeout=120)
    for i, size in enumerate(sizes):
        _, grads = xp_run(xp.one_f_one_b(2, 4), params, x[:size], y[:size])
        for k in range(2):
            assert rel(grads[k]["weight"], torch_grads[k][i][0]) <= 1e-5
            assert rel(grads[k]["bias"], torch_grads[k][i][1]) <= 1e-5


@pytest.mark.parametrize(
    "rows",
    [
        # rank 0 sends microbatch 1 first, rank 1 takes 0 first (split backward).
        ["0F1 0F0 0B0 0B1", "1F0 1B0 1F1 1I1 1W1", "2F0 2B0 2F1 2I1 2W1"],
        # the middle rank in its own order, both directions.
        [
            "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
            "1F2 1F0 1F3 1F1 1B3 1B0 1B2 1B1",
            "2F0 2F1 2F2 2F3 2B1 2B0 2B3 2B2",
        ],
    ],
)
def test_ranks_that_order_an_edge_differently_match_the_whole_model(rows: list[str]) -> None:
    """Validation refused such schedules (as out of order); the JAX runtime passes each
    microbatch's arrays by (stage, microbatch), so any order that cannot deadlock runs."""
    s = xp.schedule_from_csv("\n".join(row.replace(" ", ",") for row in rows))
    params = weights(3)
    x, y = data()
    loss, grads = xp_run(s, params, x, y)
    want_loss, want = whole(params, [0, 1, 2], x, y)
    assert abs(float(loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
    assert max_err(grads, want) <= 1e-6
