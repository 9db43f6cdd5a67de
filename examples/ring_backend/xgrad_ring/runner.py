"""The ring backend's runner: xgrad's reducer on the ring, with the step's plan as given."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from xgrad.backend import Runner, Step, StepResult, unsupported_by_declaration
from xgrad.models import shard
from xgrad.numpy_ops import NumpyOps
from xgrad.reference import MODELS, DataParallel, build_model
from xgrad_ring.comm import RingComm, run_ranks

#: world sizes the ring runs (threads on one machine).
MAX_WORLD_SIZE = 64


class RingRunner:
    """The step's model (the reference backend's numpy models) reduced over the ring."""

    name = "ring"
    description = "example out-of-tree backend: ring allreduce between threads"
    hooks: tuple[str, ...] = ("allreduce", "fp16", "bf16")
    dtypes: tuple[str, ...] = ("float64", "float32")

    def unsupported(self, step: Step) -> str | None:
        if step.model not in MODELS:
            return f"ring runs the numpy models {', '.join(MODELS)} only, not {step.model!r}"
        if step.world_size > MAX_WORLD_SIZE:
            return f"ring runs world sizes up to {MAX_WORLD_SIZE}, not {step.world_size}"
        return unsupported_by_declaration(self, step)

    def run(self, step: Step) -> StepResult:
        def rank_main(comm: RingComm) -> dict[str, np.ndarray]:
            dp = DataParallel(
                build_model(step.model, step.weights), comm, plan=step.plan, hook=step.hook
            )
            xs = shard(step.x, step.world_size, comm.rank)
            ys = shard(step.y, step.world_size, comm.rank)
            dp.zero_grad()
            dp.backward(dp.forward(xs, ys))
            return dp.grads()

        run_ranks(rank_main, step.world_size, timeout=step.timeout)  # warm-up, untimed
        start = time.perf_counter()
        for _ in range(step.steps):
            per_rank = run_ranks(rank_main, step.world_size, timeout=step.timeout)
        seconds = (time.perf_counter() - start) / step.steps
        for r, grads in enumerate(per_rank[1:], start=1):
            for key, g in grads.items():
                if not np.array_equal(g, per_rank[0][key]):
                    raise RuntimeError(f"ring rank {r} ended with a different gradient for {key!r}")
        return StepResult(per_rank[0], seconds, step.plan)


def runners() -> tuple[Runner, ...]:
    return (RingRunner(),)


def array_ops() -> tuple[NumpyOps, Callable[[np.ndarray], Any]]:
    return NumpyOps(), np.asarray
