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


def gpu_devices(count: int) -> list[Any]:
    """JAX's CUDA devices, with JAX's preallocation off so torch's ranks fit beside it.

    Raises:
        ValueError: fewer than ``count`` CUDA devices (or a CPU-only jaxlib), saying so.
    """
    # Set before JAX's GPU client starts; afterwards it has no effect (JAX would hold 75%
    # of every GPU and torch's NCCL ranks on the same GPUs could run out of memory).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    cpu_devices(count)  # fix the CPU device count first: the CPU comparison runs need it
    import jax

    try:
        found = list(jax.devices("gpu"))
    except RuntimeError:
        found = []
    if len(found) < count:
        raise ValueError(
            f"world_size={count} needs {count} CUDA devices for JAX; it sees {len(found)} "
            "(a CPU-only jaxlib? install jax[cuda12])"
        )
    return found[:count]


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
    local_batch: bool = False,
    device: str = "cpu",
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
    if devices is None:
        devices = gpu_devices(world_size) if device == "cuda" else cpu_devices(world_size)
    devices = list(devices)
    import jax

    names = list(weights)
    # float64 weights need JAX's 64-bit mode, which is off by default (arrays would be
    # silently rounded to float32); scoped to this run so other JAX code is unaffected.
    wide = any(np.dtype(w.dtype) == np.float64 for w in weights.values())
    # Full float32 matmuls, as torch's on CUDA by default (allow_tf32 off): JAX's own
    # default on a GPU is TF32-like, 6e-4 off at float32 (seen on an H200), which would
    # fail every comparison with torch for a reason the crosscheck is not about.
    with jax.enable_x64(wide), jax.default_matmul_precision("highest"):
        return _timed_run(
            model_name,
            weights,
            x,
            y,
            names,
            world_size,
            mode,
            plan,
            hook,
            steps,
            devices,
            draws,
            local_batch,
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
    local_batch: bool,
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
        local_batch=local_batch,
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
    used = plan
    if mode == "jit":
        from xgrad.jax_backend.xla_plan import xla_plan

        used = xla_plan(step.compiled_text(params, x, y), [params[n] for n in names])
    return {
        "grads": {n: _host(grads[n]) for n in names},
        "seconds_per_step": seconds,
        "plan": used,
    }


def _flat_qs(qs: Mapping[int, Sequence[np.ndarray]], like: Sequence[Any]) -> list[Any]:
    import jax.numpy as jnp

    out = []
    for b, old in enumerate(like):
        blocks = [np.ravel(q) for q in qs.get(b, ())]
        flat = np.concatenate(blocks) if blocks else np.zeros(0)
        out.append(jnp.asarray(flat, dtype=old.dtype).reshape(old.shape))
    return out


def _host(array: Any) -> np.ndarray:
    """A replicated result on the host (across processes: this process's copy)."""
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(array)
    return np.asarray(array.addressable_data(0))


def run_in_processes(
    model_name: str,
    weights: Mapping[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    *,
    num_processes: int,
    world_size: int,
    mode: str = "shard_map",
    plan: BucketPlan | None = None,
    hook: str | PowerSGD | None = None,
    steps: int = 1,
    draws: Draws | None = None,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """:func:`run_data_parallel` in ``num_processes`` JAX processes (gloo, 127.0.0.1).

    Each process gets ``world_size // num_processes`` CPU devices and passes only its own
    rows of the batch (the multi-host convention); the gradients are process 0's (every
    process holds the same).

    Raises:
        ValueError: a world size that does not split over the processes, or pmap (which
            maps over one process's devices).
        xgrad.jax_backend.processes.ProcessError: a process failed or the run timed out.
    """
    from xgrad.jax_backend.processes import run_processes

    if world_size % num_processes:
        raise ValueError(
            f"world_size={world_size} does not split over num_processes={num_processes}"
        )
    if mode == "pmap":
        raise ValueError("mode='pmap' maps over one process's devices; use shard_map or jit")
    fresh = None if draws is None else [draws(k) for k in range(1, steps + 2)]
    job = {
        "model_name": model_name,
        "weights": dict(weights),
        "x": x,
        "y": y,
        "world_size": world_size,
        "mode": mode,
        "plan": plan,
        "hook": hook,
        "steps": steps,
        "fresh": fresh,
    }
    results = run_processes(
        "xgrad.jax_backend.crosscheck:process_main",
        num_processes,
        (job,),
        devices_per_process=world_size // num_processes,
        timeout=timeout,
    )
    return results[0]  # type: ignore[no-any-return]


def process_main(process_id: int, num_processes: int, job: dict[str, Any]) -> dict[str, Any]:
    """One process of :func:`run_in_processes`: its rows, the shared step, its results."""
    from xgrad.models import shard

    fresh = job.pop("fresh")
    x = shard(job.pop("x"), num_processes, process_id)
    y = shard(job.pop("y"), num_processes, process_id)
    draws = None if fresh is None else (lambda k: fresh[k - 1])
    return run_data_parallel(
        job.pop("model_name"), job.pop("weights"), x, y, draws=draws, local_batch=True, **job
    )
