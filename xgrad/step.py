"""One data-parallel step as data: what every backend's runner is given, and what it answers.

A :class:`Step` is the same for every backend — the same weights, batch, bucket plan and
hook — so results can be compared bit for bit; :func:`make_step` builds the seeded step of a
zoo model that the crosscheck, the benches and the conformance tests share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from xgrad import models as zoo
from xgrad.buckets import BucketPlan, assign_buckets
from xgrad.powersgd import STATELESS, PowerSGD, Sampler


@dataclass(frozen=True)
class Step:
    """One data-parallel step as every backend gets it: the same weights, batch and plan.

    Attributes:
        model: a zoo model (``xgrad.models.list_models()``) or a ``ModelPair`` named
            ``"package.module:NAME"``.
        weights: ``{name: array}`` in the model's parameter order; their dtype is the
            model's (the plan's indices refer to this order).
        x, y: the global batch; rank ``r`` takes the ``r``-th contiguous shard.
        world_size: number of ranks.
        plan: the bucket plan, in launch order, that the backend should reduce with.
        hook: None (sum, then divide by the world size) or a name of
            :data:`xgrad.hooks.HOOK_NAMES`.
        steps: timed steps, after one untimed warm-up step.
        timeout: seconds the whole run may take; nothing waits longer.
        powersgd: the PowerSGD hyperparameters of hook ``"powersgd"``; a stateful one
            (error feedback, warm start) is carried over every step, the warm-up included.
        sampler: draws PowerSGD's fresh ``Q`` (a backend that can, replays it so that
            every backend starts from the same numbers); None: the backend's own draws.
        processes: for backends that can spread their ranks over several processes on
            this machine (``jax.distributed``): how many; the others ignore it.
        device: ``"cpu"`` or ``"cuda"`` (one GPU per rank); a runner declares the devices
            it runs on (``devices``, CPU only when it does not say).
    """

    model: str
    weights: Mapping[str, np.ndarray]
    x: np.ndarray
    y: np.ndarray
    world_size: int
    plan: BucketPlan
    hook: str | None = None
    steps: int = 1
    timeout: float = 120.0
    powersgd: PowerSGD = STATELESS
    sampler: Sampler | None = None
    processes: int = 1
    device: str = "cpu"

    @property
    def dtype(self) -> str:
        """The model's dtype name (``"float32"``, ``"bfloat16"``...)."""
        return np.dtype(next(iter(self.weights.values())).dtype).name


@dataclass(frozen=True)
class StepResult:
    """A runner's answer to a :class:`Step`.

    Attributes:
        grads: the reduced (averaged) gradient of every parameter, by name, in the
            model's dtype; the same on every rank.
        seconds_per_step: mean wall time of the timed steps.
        plan: the plan the backend really reduced the last step with (it may differ from
            the step's when the backend, like PyTorch's DDP, makes its own); None when the
            backend cannot say.
    """

    grads: dict[str, np.ndarray]
    seconds_per_step: float
    plan: BucketPlan | None = None

    @classmethod
    def from_answer(cls, answer: Mapping[str, Any]) -> StepResult:
        """From the plain dict a run in other processes sends back (it pickles simply):
        ``{"grads": {name: array}, "seconds_per_step": float, "plan": BucketPlan | None}``.
        """
        return cls(
            grads={k: np.asarray(v) for k, v in answer["grads"].items()},
            seconds_per_step=float(answer["seconds_per_step"]),
            plan=answer.get("plan"),
        )


def capped_plan(weights: Mapping[str, np.ndarray], bucket_cap_bytes: int) -> BucketPlan:
    """Every bucket capped at ``bucket_cap_bytes``, launched last parameters first.

    That is the plan DDP's assignment gives for that cap (no dtype mixing), in DDP's launch
    order (gradients of the last layers are ready first).
    """
    arrays = list(weights.values())
    nbytes = [int(a.nbytes) for a in arrays]
    keys = [a.dtype.name for a in arrays]
    return assign_buckets(nbytes, [bucket_cap_bytes], keys=keys).reversed()


def make_step(
    model: str = "mlp",
    *,
    world_size: int = 2,
    dtype: str = "float32",
    bucket_cap_bytes: int = 2048,
    hook: str | None = None,
    batch_per_rank: int = 4,
    seed: int = 0,
    steps: int = 1,
    timeout: float = 120.0,
) -> Step:
    """The seeded step of zoo model ``model``: its weights, a global batch, a capped plan."""
    weights = zoo.init_weights(model, seed, dtype)
    x, y = zoo.make_batch(model, seed, world_size * batch_per_rank, dtype)
    return Step(
        model,
        weights,
        x,
        y,
        world_size,
        capped_plan(weights, bucket_cap_bytes),
        hook,
        steps,
        timeout,
    )
