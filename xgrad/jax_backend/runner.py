"""The JAX backend's runners: the step's plan reduced under ``shard_map``, ``jax.jit`` and ``pmap``.

``jax-shard_map`` is xgrad's bucketed reduction; ``jax-jit`` lets XLA place and combine the
reductions itself (GSPMD), which shows what its own combiner does to the numbers;
``jax-pmap`` runs the ``shard_map`` step under ``jax.pmap`` as a cross-check. With
``Step.processes > 1`` the ranks are spread over that many JAX processes
(``jax.distributed`` over gloo on 127.0.0.1), each passing only its own rows.

Importing this module does not import JAX; each run does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from xgrad.backend import Runner, Step, StepResult, unsupported_by_declaration
from xgrad.hooks import HOOK_NAMES
from xgrad.powersgd_hook import fresh_draws


@dataclass(frozen=True)
class JaxRunner:
    """A zoo model's data-parallel step on ``world_size`` JAX CPU devices, in one ``mode``."""

    name: str
    description: str
    mode: str
    hooks: tuple[str, ...] = HOOK_NAMES
    dtypes: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")
    devices: tuple[str, ...] = ("cpu", "cuda")

    def unsupported(self, step: Step) -> str | None:
        if step.device == "cuda":
            from xgrad.jax_backend.crosscheck import gpu_devices

            if step.processes > 1:
                return "several JAX processes run on the CPU here (gloo); use one with cuda"
            try:
                gpu_devices(step.world_size)
            except ValueError as err:
                return str(err)
        if self.mode == "pmap" and step.processes > 1:
            return (
                "jax.pmap maps over one process's devices; several processes need shard_map or jit"
            )
        if step.world_size % step.processes:
            return f"{step.processes} processes do not split world_size={step.world_size}"
        declared = unsupported_by_declaration(self, step)
        if declared is not None or step.processes > 1:
            return declared
        from xgrad.jax_backend.crosscheck import cpu_devices

        count = len(cpu_devices(step.world_size))
        if step.world_size > count:
            return (
                f"world size {step.world_size} needs {step.world_size} JAX CPU devices, this "
                f"process has {count} (set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{step.world_size} before JAX starts)"
            )
        return None

    def run(self, step: Step) -> StepResult:
        from xgrad.jax_backend.crosscheck import run_data_parallel, run_in_processes

        hook: Any = step.hook
        draws = None
        if hook == "powersgd":
            hook = step.powersgd
            if step.sampler is not None:
                # The step's draws (torch's, replayed), so that every backend starts from
                # the same Q: round k before the k-th PowerSGD step.
                names = list(step.weights)
                shapes = [[step.weights[names[i]].shape for i in b] for b in step.plan.buckets]
                rounds = list(
                    itertools.islice(
                        fresh_draws(shapes, hook, step.dtype, step.sampler), step.steps + 1
                    )
                )

                def draws(k: int) -> Any:
                    return rounds[k - 1]

        common: dict[str, Any] = {
            "world_size": step.world_size,
            "mode": self.mode,
            "plan": step.plan,
            "hook": hook,
            "steps": step.steps,
            "draws": draws,
        }
        if step.device != "cpu":
            common["device"] = step.device
        if step.processes > 1:
            answer = run_in_processes(
                step.model,
                step.weights,
                step.x,
                step.y,
                num_processes=step.processes,
                timeout=step.timeout,
                **common,
            )
        else:
            answer = run_data_parallel(step.model, step.weights, step.x, step.y, **common)
        return StepResult.from_answer(answer)


def runners() -> tuple[Runner, ...]:
    """shard_map (xgrad's reduction), jit (XLA's), then pmap (a cross-check)."""
    return (
        JaxRunner("jax-shard_map", "xgrad JAX under jax.shard_map", "shard_map"),
        JaxRunner(
            "jax-jit",
            "JAX's own reduction: jax.jit with NamedSharding (GSPMD, no plan, no hook)",
            "jit",
            hooks=(),
        ),
        JaxRunner("jax-pmap", "xgrad JAX under jax.pmap (a cross-check of shard_map)", "pmap"),
    )
