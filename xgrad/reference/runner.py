"""The reference backend as a :class:`~xgrad.backend.Runner`: simulated ranks, numpy models."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from xgrad.backend import Comm, Runner, Step, StepResult, Truth, unsupported_by_declaration
from xgrad.numpy_ops import NumpyOps
from xgrad.reducer_types import ArrayOps
from xgrad.reference.comm import DEFAULT_TIMEOUT_S, spawn
from xgrad.reference.ddp import run_data_parallel, single_process_grads
from xgrad.reference.models import MODELS
from xgrad.reference.rank_threads import MAX_RANKS

T = TypeVar("T")


class ReferenceRunner:
    """xgrad's engine and reducer on simulated ranks, with the step's plan as given."""

    name = "reference"
    description = "xgrad's in-process reference backend (simulated ranks)"
    hooks: tuple[str, ...] = ("allreduce", "fp16", "bf16")
    dtypes: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")
    #: one thread per rank: the crosscheck refuses a larger world before anything runs.
    max_world_size = MAX_RANKS
    max_world_size_why = "one thread per simulated rank, in one process"

    def unsupported(self, step: Step) -> str | None:
        if step.model not in MODELS:
            return f"the reference backend implements {', '.join(MODELS)} only"
        return unsupported_by_declaration(self, step)

    def run(self, step: Step) -> StepResult:
        def once() -> dict[str, np.ndarray]:
            return run_data_parallel(
                step.weights,
                step.x,
                step.y,
                world_size=step.world_size,
                plan=step.plan,
                hook=step.hook,
                model=step.model,
                steps=1,
                timeout=step.timeout,
            )

        once()  # untimed, as the other runners' warm-up step: one-time set-up is not a step
        start = time.perf_counter()
        grads = once()
        return StepResult(dict(grads), time.perf_counter() - start, step.plan)


def runners() -> tuple[Runner, ...]:
    """The reference backend's one runner."""
    return (ReferenceRunner(),)


def run_ranks(
    fn: Callable[[Comm], T], world_size: int, *, timeout: float = DEFAULT_TIMEOUT_S
) -> list[T]:
    """``fn(comm)`` on ``world_size`` simulated ranks; results by rank."""
    return spawn(fn, world_size, timeout=timeout)


def array_ops() -> tuple[ArrayOps[np.ndarray], Callable[[np.ndarray], Any]]:
    """NumPy's reducer operations; the native array is the numpy array itself."""
    return NumpyOps(), np.asarray


def _float64_grads(
    model: str, weights: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray
) -> dict[str, np.ndarray]:
    wide = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    return single_process_grads(
        wide, np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), model
    )


def truth() -> Truth:
    """xgrad's own engine on the numpy models in float64 (not independent of xgrad)."""
    return Truth(
        grads=_float64_grads,
        covers=lambda model: model in MODELS,
        description="numpy float64 (xgrad.reference), one process, full batch",
        independent=False,
    )
