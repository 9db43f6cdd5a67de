"""A crosscheck case: its configuration, tolerances, inputs and shared bucket plan."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from xgrad import models as zoo
from xgrad.buckets import BucketPlan
from xgrad.hooks import HOOK_NAMES
from xgrad.step import StepResult, capped_plan

#: tolerance on ``rel`` per model dtype (a few roundings of the dtype's epsilon, over a
#: forward and backward pass of a small model and one reduction).
DTYPE_TOLERANCES: dict[str, float] = {
    "float64": 1e-12,
    "float32": 1e-6,
    "float16": 1e-2,
    "bfloat16": 5e-2,
}

#: tolerance on ``rel`` added by a compression hook: a few ULPs of its wire dtype
#: (float16 has 11 significant bits, bfloat16 8).
HOOK_TOLERANCES: dict[str, float] = {"fp16": 2e-3, "bf16": 1.6e-2}

#: PowerSGD is lossy by design, so it is not judged against the exact gradient but against
#: the *PowerSGD model* (:func:`powersgd_model`); orthogonalizing divides by norms, which
#: costs a few more roundings than a plain reduction: 10x the dtype's tolerance.
POWERSGD_FACTOR = 10.0

#: wire dtypes of the compression hooks.
WIRE_DTYPES: dict[str, str] = {"fp16": "float16", "bf16": "bfloat16"}

#: where a case's ranks compute: the CPU (gloo) or one CUDA device per rank (NCCL).
DEVICES: tuple[str, ...] = ("cpu", "cuda")

#: default byte cap of a bucket: small enough that the default MLP gets several buckets.
DEFAULT_CAP_BYTES = 2048


def tolerance(dtype: str, hook: str | None = None) -> float:
    """The largest ``rel`` a backend may show for a case of ``dtype`` with ``hook``."""
    base = DTYPE_TOLERANCES[zoo.as_dtype(dtype).name]
    if hook == "powersgd":
        return POWERSGD_FACTOR * base
    return max(base, HOOK_TOLERANCES.get(hook or "", 0.0))


@dataclass(frozen=True)
class Case:
    """One crosscheck configuration.

    Attributes:
        model: a zoo model (``xgrad.models.list_models()``).
        world_size: number of ranks (processes for torch, devices for JAX).
        dtype: the model's dtype (weights, data, gradients).
        bucket_cap_bytes: bucket cap of the shared plan (every bucket, like DDP's rebuilt
            plan); the plan is launched last parameters first, as DDP does.
        hook: None, ``"allreduce"``, ``"fp16"`` or ``"bf16"``.
        batch_per_rank: samples per rank; the global batch is ``world_size`` times this.
        seed: seeds weights and batch.
        steps: timed steps per backend (after one untimed warm-up step; a DDP's first,
            which rebuilds its buckets, is run untimed too where more than one runs).
        timeout: seconds a multi-process backend may take before it is stopped.
        stateful: PowerSGD's multi-step mode: PyTorch's default state (error feedback,
            warm start, from the third step), carried over every step, so the gradients
            compared (the last step's) depend on all of them.
        jax_processes: JAX runs in this many processes (``jax.distributed`` over gloo on
            127.0.0.1, ``world_size / jax_processes`` devices each), each passing only
            its own rows of the batch.
        device: ``"cpu"`` or ``"cuda"`` (torch on NCCL, one process per GPU; JAX on the
            same GPUs); with ``"cuda"`` the report also compares each runner with its own
            CPU run.
    """

    model: str = "mlp"
    world_size: int = 2
    dtype: str = "float32"
    bucket_cap_bytes: int = DEFAULT_CAP_BYTES
    hook: str | None = None
    batch_per_rank: int = 4
    seed: int = 0
    steps: int = 5
    timeout: float = 120.0
    stateful: bool = False
    jax_processes: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        zoo.get_spec(self.model)
        zoo.as_dtype(self.dtype)
        for label in ("world_size", "bucket_cap_bytes", "batch_per_rank", "steps", "jax_processes"):
            value = getattr(self, label)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label}={value!r} must be a positive integer")
        if self.hook is not None and self.hook not in HOOK_NAMES:
            raise ValueError(f"hook={self.hook!r}: expected None or one of {HOOK_NAMES}")
        if self.world_size % self.jax_processes:
            raise ValueError(
                f"jax_processes={self.jax_processes} does not divide world_size={self.world_size}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}: expected one of {DEVICES}")
        if self.stateful and self.hook != "powersgd":
            raise ValueError(f"stateful=True is PowerSGD's multi-step mode; hook={self.hook!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout!r} must be > 0 seconds")


@dataclass(frozen=True)
class Inputs:
    """What every runner of a case gets: the same weights, batch and plan."""

    case: Case
    weights: dict[str, np.ndarray]
    x: np.ndarray
    y: np.ndarray
    plan: BucketPlan


#: a runner's answer (the backend seam's name for it).
RunResult = StepResult


def bucket_plan(weights: Mapping[str, np.ndarray], bucket_cap_bytes: int) -> BucketPlan:
    """The shared plan: every bucket capped at ``bucket_cap_bytes``, launched in reverse."""
    return capped_plan(weights, bucket_cap_bytes)


def make_inputs(case: Case) -> Inputs:
    """Seeded weights and batch of the case's model and dtype, and the shared plan."""
    weights = zoo.init_weights(case.model, case.seed, case.dtype)
    x, y = zoo.make_batch(case.model, case.seed, case.world_size * case.batch_per_rank, case.dtype)
    return Inputs(case, weights, x, y, bucket_plan(weights, case.bucket_cap_bytes))
