"""The torch backend's runners: xgrad's DDP and PyTorch's own DDP, on real gloo processes.

Importing this module does not import torch (the crosscheck lists runners on machines
without it); each run does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from xgrad import models as zoo
from xgrad.backend import Comm, Runner, Step, StepResult, Truth, unsupported_by_declaration
from xgrad.hooks import HOOK_NAMES

T = TypeVar("T")

DTYPES: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")

#: memory one gloo rank takes on the CPU: torch imported, a zoo model's DDP after a step
#: (about 250 MiB resident, measured on torch 2.13), rounded up.
RANK_BYTES = 300 * 2**20


def available_bytes() -> int | None:
    """The memory new processes can still take (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class DDPRunner:
    """A zoo model under a DDP on ``world_size`` gloo processes (see ``run_ddp``).

    Attributes:
        implementation: ``"xgrad"`` (reduces with the step's plan as given) or ``"torch"``
            (PyTorch's DDP, which makes its own plan from the step's cap).
    """

    name: str
    description: str
    implementation: str
    hooks: tuple[str, ...] = HOOK_NAMES
    dtypes: tuple[str, ...] = DTYPES
    devices: tuple[str, ...] = ("cpu", "cuda")

    @property
    def max_world_size(self) -> int | None:
        """The ranks whose processes fit in this machine's free memory (None: unknown).

        One process per rank on this machine: a world size far past it (a typo) forked
        processes until the machine ran out of memory, where the crosscheck's check of
        ``--world-size`` now names the limit before anything starts.
        """
        free = available_bytes()
        return None if free is None else max(1, free // RANK_BYTES)

    @property
    def max_world_size_why(self) -> str:
        free = available_bytes() or 0
        return (
            f"one process per rank on this machine, about {RANK_BYTES // 2**20} MiB each, "
            f"{free / 2**30:.1f} GiB available"
        )

    def unsupported(self, step: Step) -> str | None:
        if step.device == "cuda":
            import torch

            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if found < step.world_size:
                return (
                    f"world_size={step.world_size} needs {step.world_size} CUDA devices (one "
                    f"process per GPU, NCCL); {found} here"
                )
        elif self.implementation == "torch" and step.hook == "bf16":
            return "PyTorch's bf16_compress_hook needs NCCL on CUDA; these ranks run gloo on CPU"
        if (
            self.implementation == "torch"
            and step.hook == "powersgd"
            and len(step.plan.buckets) > 1
        ):
            # PyTorch's DDP runs the buckets' hooks concurrently; on gloo PowerSGD's callbacks
            # then issue collectives in completion order, which differs between ranks, and the
            # ranks hang. xgrad's DDP finishes one bucket's hook before the next on gloo.
            return (
                "PyTorch's DDP hangs with powerSGD_hook and several buckets on gloo (collectives "
                "issued from callbacks in a different order on each rank); use one bucket "
                "(a larger --bucket-cap) to compare with it"
            )
        return unsupported_by_declaration(self, step)

    def run(self, step: Step) -> StepResult:
        from xgrad.torch_backend.crosscheck import run_ddp

        answer = run_ddp(
            step.model,
            dict(step.weights),
            step.x,
            step.y,
            world_size=step.world_size,
            implementation=self.implementation,
            plan=step.plan if self.implementation == "xgrad" else None,
            bucket_cap_mb=max(step.plan.limits) / 2**20,
            hook=step.hook,
            steps=step.steps,
            timeout=step.timeout,
            powersgd=dataclasses.asdict(step.powersgd),
            device=step.device,
        )
        return StepResult.from_answer(answer)


def runners() -> tuple[Runner, ...]:
    """xgrad's DDP, then PyTorch's."""
    return (
        DDPRunner("torch-xgrad", "xgrad's DDP on real gloo processes", "xgrad"),
        DDPRunner("torch-ddp", "PyTorch's own DDP on real gloo processes", "torch"),
    )


def _comm_main(rank: int, world_size: int, fn: Callable[[Comm], Any], timeout: float) -> Any:
    from xgrad.torch_backend.comm import TorchComm

    return fn(TorchComm(timeout=timeout))


def run_ranks(fn: Callable[[Comm], T], world_size: int, *, timeout: float = 120.0) -> list[T]:
    """``fn(comm)`` in ``world_size`` gloo processes (``fn`` must be picklable); by rank."""
    from xgrad.torch_backend.spawn import spawn

    return spawn(_comm_main, world_size, args=(fn, timeout), timeout=timeout)


def array_ops() -> tuple[Any, Callable[[np.ndarray], Any]]:
    """torch's reducer operations, and numpy -> CPU tensor."""
    import torch

    from xgrad.torch_backend.ops import TorchArrayOps

    return TorchArrayOps(), lambda a: torch.from_numpy(np.array(a, copy=True))


def _float64_grads(
    model: str, weights: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray
) -> dict[str, np.ndarray]:
    from xgrad.torch_backend.models import single_process_grads

    return single_process_grads(model, dict(weights), x, y)


def truth() -> Truth:
    """torch's autograd in float64, for every zoo model and model pair."""
    return Truth(
        grads=_float64_grads,
        covers=lambda model: model in zoo.MODELS or zoo.is_pair_name(model),
        description="torch float64, one process, full batch",
        independent=True,
    )
