"""The JAX runners of ``xgrad crosscheck``: a zoo model's reduced gradients under shard_map, jit or pmap."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from xgrad.buckets import BucketPlan
from xgrad.powersgd import PowerSGD

#: ``draws(k)``: bucket -> the fresh ``Q`` blocks of the ``k``-th draw (1-based), e.g. torch's.
Draws = Callable[[int], Mapping[int, Sequence[np.ndarray]]]


def cpu_devices(count: int) -> list[Any]:
    """JAX's CPU devices, asking for ``count`` of them when JAX has not started yet.

    The crosscheck and the benchmark compare with torch on gloo, on the CPU, so JAX runs
    there too, also where it could use accelerators. JAX fixes its device list when its
    backend first starts; before that the CPU device count can still be set. Afterwards
    :func:`data_parallel_value_and_grad` reports a too small list with the remedy.
    """
    import jax

    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # (Where XLA_FLAGS sets the count, as the test suite does, the config would override it.)
        try:
            if int(getattr(jax.config, "jax_num_cpu_devices", -1)) < count:
                jax.config.update("jax_num_cpu_devices", count)
        except RuntimeError:
            pass  # the backend is already running: its device list is final
    return list(jax.devices("cpu"))


def run_data_parallel(
    model_name: str,
    weights: Mapping[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    *,
    world_size: int,
    mode: str = "shard_map",
    plan: BucketPlan | None = None,
    hook: str | PowerSGD | None = None,
    steps: int = 1,
    draws: Draws | None = None,
    devices: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Reduced gradients of zoo model ``model_name`` on ``world_size`` JAX devices.

    The first call compiles; ``steps`` more calls are timed (blocking on the results), so
    ``seconds_per_step`` excludes compilation. Every call differentiates at ``weights``
    (no optimizer step), as the torch runners do; a stateful hook's state is carried from
    call to call, so the last gradients depend on every step before them.

    With PowerSGD, ``draws`` supplies the fresh ``Q`` (torch's replayed draws, so both
    start from the same numbers): the first draw at ``init``, and, without warm start, the
    ``k``-th before the ``k``-th PowerSGD step, as torch draws them.

    Returns:
        ``{"grads": {name: np.ndarray}, "seconds_per_step": float, "plan": plan}`` with the
        gradients in ``weights``' order and dtype.
    """
    devices = cpu_devices(world_size) if devices is None else list(devices)
    import jax

    names = list(weights)
    # float64 weights need JAX's 64-bit mode, which is off by default (arrays would be
    # silently rounded to float32); scoped to this run so other JAX code is unaffected.
    wide = any(np.dtype(w.dtype) == np.float64 for w in weights.values())
    with jax.enable_x64(wide):
        return _timed_run(
            model_name, weights, x, y, names, world_size, mode, plan, hook, steps, devices, draws
        )


def _timed_run(
    model_name: str,
    weights: Mapping[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    names: list[str],
    world_size: int,
    mode: str,
    plan: BucketPlan | None,
    hook: str | PowerSGD | None,
    steps: int,
    devices: list[Any],
    draws: Draws | None,
) -> dict[str, Any]:
    import jax

    from xgrad.jax_backend import models as jm
    from xgrad.jax_backend.data_parallel import data_parallel_value_and_grad

    step = data_parallel_value_and_grad(
        jm.make_loss(jm.get_apply(model_name)),
        world_size=world_size,
        plan=None if mode == "jit" else plan,
        names=names,
        hook=hook,
        mode=mode,
        devices=devices,
    )
    params = jm.to_params(weights)
    config = step.hook if isinstance(step.hook, PowerSGD) else None
    state = None if config is None else step.init(params, qs=None if draws is None else draws(1))
    fresh = 0  # PowerSGD steps whose draws were used

    def call() -> Any:
        nonlocal state, fresh
        if config is None:
            return jax.block_until_ready(step(params, x, y))[1]
        assert state is not None
        if int(state.iter) >= config.start_powerSGD_iter:
            fresh += 1
            if not config.warm_start and draws is not None and fresh > 1:
                state = state._replace(qs=tuple(_flat_qs(draws(fresh), state.qs)))
        _, grads, state = jax.block_until_ready(step(params, x, y, hook_state=state))
        return grads

    grads = call()
    start = time.perf_counter()
    for _ in range(max(steps, 1)):
        grads = call()
    seconds = (time.perf_counter() - start) / max(steps, 1)
    return {
        "grads": {n: np.asarray(grads[n]) for n in names},
        "seconds_per_step": seconds,
        "plan": None if mode == "jit" else plan,
    }


def _flat_qs(qs: Mapping[int, Sequence[np.ndarray]], like: Sequence[Any]) -> list[Any]:
    import jax.numpy as jnp

    out = []
    for b, old in enumerate(like):
        blocks = [np.ravel(q) for q in qs.get(b, ())]
        flat = np.concatenate(blocks) if blocks else np.zeros(0)
        out.append(jnp.asarray(flat, dtype=old.dtype).reshape(old.shape))
    return out
