"""The JAX backend's runners: the step's plan reduced under ``jax.pmap`` and ``jax.shard_map``.

Importing this module does not import JAX; each run does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from xgrad.backend import Runner, Step, StepResult, unsupported_by_declaration
from xgrad.hooks import HOOK_NAMES


@dataclass(frozen=True)
class JaxRunner:
    """A zoo model's data-parallel step on ``world_size`` JAX CPU devices, in one ``mode``."""

    name: str
    description: str
    mode: str
    hooks: tuple[str, ...] = HOOK_NAMES
    dtypes: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")

    def unsupported(self, step: Step) -> str | None:
        declared = unsupported_by_declaration(self, step)
        if declared is not None:
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
        from xgrad.jax_backend.crosscheck import run_data_parallel

        hook: Any = step.hook
        if hook == "powersgd":
            # torch's powerSGD_hook, replayed from torch's own random draws so that every
            # backend starts from the same Q (the PowerSGD model's too).
            from xgrad.jax_backend.powersgd import PowerSGD
            from xgrad.torch_backend import powersgd as torch_powersgd

            qs = torch_powersgd.initial_qs(step.weights, step.plan, step.steps)
            hook = PowerSGD(torch_powersgd.POWERSGD_RANK, torch_powersgd.POWERSGD_MIN_RATE, qs=qs)
        answer = run_data_parallel(
            step.model,
            step.weights,
            step.x,
            step.y,
            world_size=step.world_size,
            mode=self.mode,
            plan=step.plan,
            hook=hook,
            steps=step.steps,
        )
        return StepResult(
            grads={k: np.asarray(v) for k, v in answer["grads"].items()},
            seconds_per_step=float(answer["seconds_per_step"]),
            plan=answer.get("plan"),
        )


def runners() -> tuple[Runner, ...]:
    """pmap, then shard_map."""
    return (
        JaxRunner("jax-pmap", "xgrad JAX under jax.pmap", "pmap"),
        JaxRunner("jax-shard_map", "xgrad JAX under jax.shard_map", "shard_map"),
    )
