"""The backends as runners: the reference, torch (xgrad's, PyTorch's) and JAX (pmap, shard_map)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xgrad.crosscheck.case import Case, Inputs, RunResult, make_inputs
from xgrad.crosscheck.truth import powersgd_config, torch_powersgd_qs


@dataclass(frozen=True)
class Runner:
    """A backend as the crosscheck drives it.

    Attributes:
        name: the column name (``"torch-xgrad"``).
        description: one line for the progress display.
        modules: modules that must be importable; if one is missing the runner is skipped.
        run: computes the reduced gradients of a case.
        unsupported: why a case cannot run here (None when it can); skipped with that reason.
    """

    name: str
    description: str
    modules: tuple[str, ...]
    run: Callable[[Inputs], RunResult]
    unsupported: Callable[[Case], str | None] = field(default=lambda case: None)


def _as_result(answer: Mapping[str, Any]) -> RunResult:
    return RunResult(
        grads={k: np.asarray(v) for k, v in answer["grads"].items()},
        seconds_per_step=float(answer["seconds_per_step"]),
        plan=answer.get("plan"),
    )


def _run_reference(inputs: Inputs) -> RunResult:
    from xgrad.reference import run_data_parallel

    case = inputs.case

    def run() -> dict[str, np.ndarray]:
        return run_data_parallel(
            inputs.weights,
            inputs.x,
            inputs.y,
            world_size=case.world_size,
            plan=inputs.plan,
            bucket_cap_bytes=case.bucket_cap_bytes,
            hook=case.hook,
            model=case.model,
            steps=1,
        )

    run()  # untimed, as the torch runners' warm-up step: one-time set-up is not a step
    start = time.perf_counter()
    grads = run()
    return RunResult(dict(grads), time.perf_counter() - start, inputs.plan)


def _reference_unsupported(case: Case) -> str | None:
    if case.hook == "powersgd":
        return "the reference backend has no PowerSGD hook"
    reference = importlib.import_module("xgrad.reference")
    supported = tuple(getattr(reference, "MODELS", ("mlp",)))
    if case.model not in supported:
        return f"the reference backend implements {', '.join(supported)} only"
    return None


def _torch_runner(implementation: str) -> Callable[[Inputs], RunResult]:
    def run(inputs: Inputs) -> RunResult:
        from xgrad.torch_backend.crosscheck import run_ddp

        case = inputs.case
        answer = run_ddp(
            case.model,
            inputs.weights,
            inputs.x,
            inputs.y,
            world_size=case.world_size,
            implementation=implementation,
            plan=inputs.plan if implementation == "xgrad" else None,
            bucket_cap_mb=case.bucket_cap_bytes / 2**20,
            hook=case.hook,
            steps=case.steps,
            timeout=case.timeout,
            powersgd=dataclasses.asdict(powersgd_config(case.stateful)),
        )
        return _as_result(answer)

    return run


def _jax_runner(mode: str) -> Callable[[Inputs], RunResult]:
    def run(inputs: Inputs) -> RunResult:
        from xgrad.jax_backend.crosscheck import run_data_parallel, run_in_processes

        case = inputs.case
        hook: Any = case.hook
        draws = None
        if hook == "powersgd":
            hook = powersgd_config(case.stateful)
            if importlib.util.find_spec("torch") is not None:

                def draws(k: int) -> Any:
                    return torch_powersgd_qs(inputs.weights, inputs.plan, k)

        if case.jax_processes > 1:
            answer = run_in_processes(
                case.model,
                inputs.weights,
                inputs.x,
                inputs.y,
                num_processes=case.jax_processes,
                world_size=case.world_size,
                mode=mode,
                plan=inputs.plan,
                hook=hook,
                steps=case.steps,
                draws=draws,
                timeout=case.timeout,
            )
        else:
            answer = run_data_parallel(
                case.model,
                inputs.weights,
                inputs.x,
                inputs.y,
                world_size=case.world_size,
                mode=mode,
                plan=inputs.plan,
                hook=hook,
                steps=case.steps,
                draws=draws,
            )
        return _as_result(answer)

    return run


def _jax_pmap_unsupported(case: Case) -> str | None:
    if case.jax_processes > 1:
        return "jax.pmap maps over one process's devices; several processes need shard_map or jit"
    return None


def _jax_jit_unsupported(case: Case) -> str | None:
    if case.hook is not None:
        return f"jax.jit lets XLA combine the reductions: it runs no hook ({case.hook})"
    return None


def _torch_ddp_unsupported(case: Case) -> str | None:
    if case.hook == "bf16":
        return "PyTorch's bf16_compress_hook needs NCCL on CUDA; these ranks run gloo on CPU"
    return _torch_powersgd_unsupported(case)


def _torch_powersgd_unsupported(case: Case) -> str | None:
    if case.hook == "powersgd" and len(make_inputs(case).plan.buckets) > 1:
        # PyTorch's DDP runs the buckets' hooks concurrently; on gloo PowerSGD's callbacks
        # then issue collectives in completion order, which differs between ranks, and the
        # ranks hang. xgrad's DDP finishes one bucket's hook before the next on gloo.
        return (
            "PyTorch's DDP hangs with powerSGD_hook and several buckets on gloo (collectives "
            "issued from callbacks in a different order on each rank); use one bucket "
            "(a larger --bucket-cap-bytes) to compare with it"
        )
    return None


RUNNERS: dict[str, Runner] = {
    runner.name: runner
    for runner in (
        Runner(
            "reference",
            "xgrad's in-process reference backend (simulated ranks)",
            ("xgrad.reference",),
            _run_reference,
            _reference_unsupported,
        ),
        Runner(
            "torch-xgrad",
            "xgrad's DDP on real gloo processes",
            ("torch", "xgrad.torch_backend.crosscheck"),
            _torch_runner("xgrad"),
        ),
        Runner(
            "torch-ddp",
            "PyTorch's own DDP on real gloo processes",
            ("torch", "xgrad.torch_backend.crosscheck"),
            _torch_runner("torch"),
            _torch_ddp_unsupported,
        ),
        Runner(
            "jax-shard_map",
            "xgrad JAX under jax.shard_map",
            ("jax", "xgrad.jax_backend.crosscheck"),
            _jax_runner("shard_map"),
        ),
        Runner(
            "jax-jit",
            "JAX's own reduction: jax.jit with NamedSharding (GSPMD, no plan)",
            ("jax", "xgrad.jax_backend.crosscheck"),
            _jax_runner("jit"),
            _jax_jit_unsupported,
        ),
        Runner(
            "jax-pmap",
            "xgrad JAX under jax.pmap (a cross-check of shard_map)",
            ("jax", "xgrad.jax_backend.crosscheck"),
            _jax_runner("pmap"),
            _jax_pmap_unsupported,
        ),
    )
}


def missing_module(modules: Sequence[str]) -> str | None:
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"{module} is not importable"
    return None
