"""Stateful PowerSGD in JAX against xgrad's float64 model and PyTorch's own hook."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

from xgrad import crosscheck, models  # noqa: E402
from xgrad.buckets import BucketPlan  # noqa: E402
from xgrad.crosscheck import Case  # noqa: E402
from xgrad.jax_backend import models as jm  # noqa: E402
from xgrad.jax_backend.crosscheck import run_data_parallel  # noqa: E402
from xgrad.jax_backend.data_parallel import data_parallel_value_and_grad  # noqa: E402
from xgrad.jax_backend.reduce import plan_for  # noqa: E402
from xgrad.powersgd import PowerSGD  # noqa: E402
from xgrad.torch_backend.powersgd import torch_sampler  # noqa: E402

STEPS = 2


CASES = {
    label: Case(
        world_size=2, steps=steps, bucket_cap_bytes=1 << 20, hook="powersgd", stateful=stateful
    )
    for label, stateful, steps in (("stateless", False, STEPS), ("stateful", True, 9))
}


def _torch_rank(rank: int, world_size: int) -> Any:
    """PyTorch's DDP with its own powerSGD_hook, per case: every step's gradients."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel

    from xgrad.torch_backend.models import build, loss, to_numpy

    out = {}
    for label, case in CASES.items():
        inputs = crosscheck.make_inputs(case)
        module = build(case.model, inputs.weights)
        ddp = DistributedDataParallel(module, bucket_cap_mb=case.bucket_cap_bytes / 2**20)
        config = crosscheck.powersgd_config(case.stateful)
        kwargs = {k: getattr(config, k) for k in config.__dataclass_fields__}
        ddp.register_comm_hook(psgd.PowerSGDState(None, **kwargs), psgd.powerSGD_hook)
        x = torch.from_numpy(models.shard(inputs.x, world_size, rank))
        y = torch.from_numpy(models.shard(inputs.y, world_size, rank))
        steps = []
        for _ in range(case.steps + 1):
            module.zero_grad(set_to_none=True)
            loss(ddp(x), y).backward()
            steps.append({n: to_numpy(p.grad) for n, p in module.named_parameters()})
        rebuilt = str(ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"])
        buckets = [[int(i) for i in b.split()] for b in rebuilt.split(",")]
        out[label] = {"steps": steps, "buckets": buckets}
    return out


@pytest.fixture(scope="module")
def torch_runs() -> dict[str, Any]:
    """PyTorch's hook on 2 gloo ranks (one spawn), one bucket (PyTorch's DDP on gloo runs
    several buckets' PowerSGD callbacks concurrently and in a different order on each
    rank), stateless (one step after the warm-up) and stateful (ten steps, error feedback
    and warm start)."""
    from xgrad.torch_backend.spawn import spawn

    answer = spawn(_torch_rank, 2, timeout=90)[0]
    out = {}
    for label, case in CASES.items():
        buckets = answer[label]["buckets"]
        assert len(buckets) == 1
        plan = BucketPlan((tuple(buckets[0]),), (1 << 20,))
        out[label] = (case, plan, answer[label]["steps"])
    return out


def test_stateless_model_and_jax_replay_pytorchs_hook(torch_runs: dict[str, Any]) -> None:
    case, plan, steps = torch_runs["stateless"]
    inputs = crosscheck.make_inputs(case)
    config = crosscheck.powersgd_config(False)
    model = crosscheck.powersgd_run(
        crosscheck.per_rank_grads(inputs),
        inputs.weights,
        plan,
        config,
        STEPS + 1,
        "float32",
        torch_sampler,
    )
    got = run_data_parallel(
        "mlp",
        inputs.weights,
        inputs.x,
        inputs.y,
        world_size=2,
        plan=plan,
        hook=config,
        steps=STEPS,
        draws=lambda k: crosscheck.torch_powersgd_qs(inputs.weights, plan, k),
    )["grads"]
    exact, _ = crosscheck.reference_grads(inputs)
    for name, grad in steps[-1].items():
        assert crosscheck.compare(name, grad, model[name], 1e-5).passed, name
        assert crosscheck.compare(name, got[name], grad, 1e-5).passed, name
    # ... and the compression is real: far from the exact gradient.
    assert max(crosscheck.compare(n, model[n], exact[n], 1).rel for n in exact) > 0.1


def test_ten_stateful_steps_equal_pytorchs_hook(torch_runs: dict[str, Any]) -> None:
    """Error feedback and warm start over ten steps: JAX follows torch step by step."""
    case, plan, steps = torch_runs["stateful"]
    inputs = crosscheck.make_inputs(case)
    config = crosscheck.powersgd_config(True)
    names = list(inputs.weights)
    step = data_parallel_value_and_grad(
        jm.make_loss(jm.mlp), world_size=2, plan=plan, names=names, hook=config
    )
    params = jm.to_params(inputs.weights)
    state = step.init(params, sampler=torch_sampler)
    for k, expected in enumerate(steps):
        _, grads, state = step(params, inputs.x, inputs.y, hook_state=state)
        for name in names:
            got = np.asarray(grads[name])
            assert crosscheck.compare(name, got, expected[name], 2e-5).passed, (k, name)
    assert int(state.iter) == len(steps)
    assert any(np.abs(np.asarray(e)).max() > 0 for e in state.errors)  # error feedback ran
    model = crosscheck.powersgd_run(
        crosscheck.per_rank_grads(inputs),
        inputs.weights,
        plan,
        config,
        len(steps),
        "float32",
        torch_sampler,
    )
    for name in names:
        assert crosscheck.compare(name, steps[-1][name], model[name], 1e-5).passed, name


@pytest.mark.slow
def test_shard_map_and_pmap_carry_the_same_state() -> None:
    w = models.init_weights("mlp", 0, "float32")
    x, y = models.make_batch("mlp", 0, 8, "float32")
    plan = plan_for(w, names=list(w), bucket_cap_bytes=2048)
    hook = PowerSGD(start_powerSGD_iter=2, warm_start=False)
    finals = {}
    for mode, bucketed in (("shard_map", True), ("pmap", True), ("shard_map", False)):
        step = data_parallel_value_and_grad(
            jm.make_loss(jm.mlp),
            world_size=2,
            names=list(w),
            hook=hook,
            mode=mode,
            plan=plan if bucketed else None,
        )
        state = step.init(jm.to_params(w))
        for _ in range(4):
            _, grads, state = step(jm.to_params(w), x, y, hook_state=state)
        finals[(mode, bucketed)] = {k: np.asarray(v) for k, v in grads.items()}
        assert state.errors[0].shape[0] == 2  # one error row per device
    for name in w:
        assert np.array_equal(finals[("pmap", True)][name], finals[("shard_map", True)][name])
    # Biases are never compressed; weights are compressed per bucket, so the plan matters.
    assert np.array_equal(
        finals[("shard_map", True)]["layers.0.bias"], finals[("shard_map", False)]["layers.0.bias"]
    )


@pytest.mark.slow
def test_adam_with_powersgd_trains_like_uncompressed() -> None:
    """200 Adam steps on a noisy teacher-student regression (4096 samples, more targets
    than parameters, so neither run can memorise the noise): rank-1 PowerSGD with
    PyTorch's default state, compressing from step 20, ends within 10% of the
    uncompressed loss."""
    import jax.numpy as jnp

    w = models.init_weights("mlp", 0, "float32")
    x, _ = models.make_batch("mlp", 0, 4096, "float32")
    teacher = jm.to_params(models.init_weights("mlp", 1, "float32"))
    noise = 0.3 * np.random.default_rng(0).standard_normal((4096, 8))
    y = (np.asarray(jm.mlp(teacher, x)) + noise).astype(np.float32)
    loss_fn = jm.make_loss(jm.mlp)

    @jax.jit
    def adam(params: Any, m: Any, v: Any, grads: Any, t: Any) -> Any:
        m = jax.tree_util.tree_map(lambda a, g: 0.9 * a + 0.1 * g, m, grads)
        v = jax.tree_util.tree_map(lambda a, g: 0.999 * a + 0.001 * g * g, v, grads)

        def move(p: Any, a: Any, b: Any) -> Any:
            return p - 1e-2 * (a / (1 - 0.9**t)) / (jnp.sqrt(b / (1 - 0.999**t)) + 1e-8)

        return jax.tree_util.tree_map(move, params, m, v), m, v

    def train(hook: Any) -> float:
        step = data_parallel_value_and_grad(loss_fn, world_size=2, names=list(w), hook=hook)
        params = jm.to_params(w)
        state = step.init(params) if hook is not None else None
        m = jax.tree_util.tree_map(jnp.zeros_like, params)
        v = jax.tree_util.tree_map(jnp.zeros_like, params)
        for t in range(1, 201):
            if state is None:
                _, grads = step(params, x, y)
            else:
                _, grads, state = step(params, x, y, hook_state=state)
            params, m, v = adam(params, m, v, grads, t)
        return float(loss_fn(params, x, y))

    start = float(loss_fn(jm.to_params(w), x, y))
    plain = train(None)
    compressed = train(PowerSGD(matrix_approximation_rank=1, start_powerSGD_iter=20))
    assert plain < 0.5 * start  # both really train
    assert compressed <= 1.1 * plain, (compressed, plain)


def test_bad_powersgd_input_is_named() -> None:
    with pytest.raises(ValueError, match="matrix_approximation_rank=0"):
        PowerSGD(matrix_approximation_rank=0)
    w = models.init_weights("mlp", 0, "float32")
    x, y = models.make_batch("mlp", 0, 8, "float32")
    plan = plan_for(w, names=list(w), bucket_cap_bytes=2048)
    step = data_parallel_value_and_grad(
        jm.make_loss(jm.mlp), world_size=2, names=list(w), plan=plan, hook="powersgd"
    )
    assert step.hook == PowerSGD()  # the CLI's spelling: PyTorch's defaults
    with pytest.raises(ValueError, match=r"hook_state=state"):
        step(jm.to_params(w), x, y)
    with pytest.raises(ValueError, match=r"qs for bucket 0 have shapes \[\(3, 1\)\], expected"):
        step.init(jm.to_params(w), qs={0: [np.zeros((3, 1))]})
    plain = data_parallel_value_and_grad(jm.make_loss(jm.mlp), world_size=2)
    with pytest.raises(ValueError, match="keeps no state"):
        plain.init(jm.to_params(w))


def test_pmap_compiles_the_powersgd_step_once() -> None:
    """The state a step returned was placed otherwise than the initial one (slices of
    pmap's outputs), and the second call compiled the step again: the crosscheck timed
    PowerSGD under pmap at half a second a step, against 2 ms under shard_map."""
    import jax

    w = models.init_weights("mlp", 0, "float32")
    x, y = models.make_batch("mlp", 0, 8, "float32")
    step = data_parallel_value_and_grad(
        jm.make_loss(jm.mlp), world_size=2, names=list(w), mode="pmap",
        hook=PowerSGD(start_powerSGD_iter=2),
    )  # fmt: skip
    params = jm.to_params(w)
    state = step.init(params)
    _, _, state = jax.block_until_ready(step(params, x, y, hook_state=state))  # compiles
    compiled: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compiled.append(event) if "backend_compile" in event else None
    )
    for _ in range(3):
        _, _, state = jax.block_until_ready(step(params, x, y, hook_state=state))
    assert compiled == []


def test_pmap_powersgd_step_inside_an_outer_jit() -> None:
    """The whole training step under ``jax.jit``, as the step's docstring asks: pmap's
    placement of the state read ``.sharding`` of the traced state and failed
    (AttributeError). An uneven batch (10 rows over 4 devices) with its state carried
    over steps gives shard_map's numbers called without a jit."""
    import jax

    w = models.init_weights("mlp", 0, "float32")
    x, y = models.make_batch("mlp", 0, 10, "float32")
    params = jm.to_params(w)
    hook = PowerSGD(start_powerSGD_iter=2)
    finals = {}
    for mode in ("shard_map", "pmap"):
        step = data_parallel_value_and_grad(
            jm.make_loss(jm.mlp), world_size=4, names=list(w), mode=mode, hook=hook
        )
        run = step if mode == "shard_map" else jax.jit(step)
        state = step.init(params)
        for _ in range(3):
            _, grads, state = run(params, x, y, hook_state=state)
        finals[mode] = grads
    for name in w:
        assert np.allclose(finals["pmap"][name], finals["shard_map"][name], rtol=1e-5, atol=1e-7)
