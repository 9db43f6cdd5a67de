"""What ``xgrad bench ddp --device cuda`` does differently from the CPU run, in one place.

The bench's loop (build, construct, alternate the sides, measure) is the same on both
devices; only a few things are not: the process group (NCCL, rank r on ``cuda:r``, since
NCCL refuses two ranks on one GPU), the checks of the world sizes against the GPUs
present, ``device_ids`` for both DDPs, the wait for the GPU before the clock is read
(kernels run asynchronously, so a step timed without it would time its launches only),
and the memory meter (the CUDA caching allocator's counters, where the CPU run reads the
C heap). They live here so that ``bench.py`` stays small and its CPU path reads, and
runs, as it did.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xgrad.torch_backend.ddp_bench_models import SCALES, build
from xgrad.torch_backend.memory import HeapMeter, PeakWatch

__all__ = [
    "BACKENDS",
    "DEVICES",
    "LABELS",
    "BenchDevice",
    "CudaMeter",
    "CudaPeak",
    "check_worlds",
    "step_peak",
]

DEVICES = ("cpu", "cuda")

#: the process group's backend per device (gloo moves CPU tensors, NCCL CUDA ones).
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}

#: how the table's header names the run per device.
LABELS = {"cpu": "gloo on CPU", "cuda": "NCCL on CUDA"}

#: ``--wide-world-size`` when not given, per device: a GPU machine often has fewer than
#: four GPUs, and the wide row would then refuse to run rather than be skipped.
WIDE_DEFAULT = {"cpu": 4, "cuda": 0}


def check_worlds(device: str, world: int, wide: int | None) -> tuple[int, int]:
    """The world size and the wide row's (0: none), checked for ``device``.

    On the CPU a world of one would time no communication (gloo's ranks are processes, so
    any number fits); on CUDA it is allowed, since one rank per GPU is all NCCL takes and a
    machine with one GPU has no other NCCL world. Checked here, in the launching process,
    so a bad value is one line of error rather than a rank's failure after start-up.

    Raises:
        ValueError: no CUDA device for ``--device cuda``, a world size below the least
            (2 on CPU, 1 on CUDA), a wide one of 1 or negative, or more ranks than GPUs.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda: no CUDA device is available here (torch.cuda.is_available() "
            "is False); run on a machine with a GPU, or use --device cpu"
        )
    least = 1 if device == "cuda" else 2
    if world < least:
        raise ValueError(f"--world-size must be at least {least}, got {world}")
    wide = WIDE_DEFAULT[device] if wide is None else wide
    if wide == 1 or wide < 0:
        raise ValueError(f"--wide-world-size must be 0 (none) or >= 2, got {wide}")
    if device == "cuda":
        count = torch.cuda.device_count()
        for option, value in (("--world-size", world), ("--wide-world-size", wide)):
            if value > count:
                raise ValueError(
                    f"{option} {value} is more than the {count} CUDA device(s) here "
                    "(NCCL takes one GPU per rank)"
                )
    return world, wide


class CudaMeter:
    """Bytes of CUDA memory in use on one device, as :class:`HeapMeter` reads the heap.

    ``torch.cuda.memory_allocated``: tensors held through the caching allocator, counted
    when the host allocates or frees them, whatever the allocator keeps cached. NCCL's
    own buffers are not allocated through it and so are not counted, for either side.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def source(self) -> str:
        """What :meth:`live` reads, for a benchmark's legend."""
        return "torch.cuda.memory_allocated"

    def live(self) -> int:
        """Bytes allocated on the device now."""
        return int(torch.cuda.memory_allocated(self.device))


class CudaPeak:
    """:class:`PeakWatch`'s interface for CUDA: the allocator keeps the peak itself.

    No polling thread is needed (the allocator's ``max_memory_allocated`` sees every
    allocation), so :meth:`sample` does nothing and the context holds nothing.
    """

    def __init__(self, meter: CudaMeter) -> None:
        self._meter = meter

    def __enter__(self) -> CudaPeak:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def sample(self) -> None:
        """Nothing to do: the allocator's peak already covers this moment."""

    def measure(self, fn: Callable[[], object]) -> int:
        """Run ``fn``; return the peak bytes allocated above those allocated just before."""
        device = self._meter.device
        torch.cuda.synchronize(device)
        start = self._meter.live()
        torch.cuda.reset_peak_memory_stats(device)  # the peak restarts from ``start``
        try:
            fn()
        finally:
            torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device)) - start


def step_peak(
    meter: HeapMeter | CudaMeter,
    zero_grad: Callable[[], object],
    step: Callable[..., object],
    steps: int = 3,
) -> int:
    """Peak bytes above the start of a step, the most over ``steps`` steps.

    On the CPU a thread polls the heap while the step runs (:class:`PeakWatch`), rather
    than sampling in gradient hooks: PyTorch's reducer runs its hooks at another point of
    the autograd node than tensor hooks do, so samples taken in hooks would see the two
    implementations at different moments (the backward pass runs without the GIL, so the
    poller gets to run throughout). The step also samples at the ends of its forward and
    backward passes (``step(sample=...)``), so short peaks there are not missed. On CUDA
    the allocator's own peak counter does all of this (:class:`CudaPeak`).
    """
    watch = PeakWatch(meter) if isinstance(meter, HeapMeter) else CudaPeak(meter)
    peak = 0
    with watch:
        for _ in range(steps):
            zero_grad()
            peak = max(peak, watch.measure(lambda: step(sample=watch.sample)))
    return peak


class BenchDevice:
    """One rank's device in the bench: where the model and data live, what DDP is told,
    how a timed step ends, and what meters memory.

    On the CPU every method does what the bench did before there was a choice (nothing
    moved, no ``device_ids``, no wait), so the CPU run is unchanged.
    """

    def __init__(self, kind: str, rank: int) -> None:
        self.cuda = kind == "cuda"
        self.rank = rank
        self.torch = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        #: extra arguments of both DDPs' construction: each rank's module on its own GPU.
        self.ddp_kwargs: dict[str, Any] = {"device_ids": [rank]} if self.cuda else {}

    def meter(self) -> HeapMeter | CudaMeter:
        """The memory meter of this device."""
        return CudaMeter(self.torch) if self.cuda else HeapMeter()

    def build(self, name: str, scale: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
        """:func:`build`'s model, batch and targets, on this device."""
        model, x, y = build(name, SCALES[name][scale])
        if not self.cuda:
            return model, x, y
        return model.to(self.torch), x.to(self.torch), y.to(self.torch)

    def finish(self) -> None:
        """Wait for the GPU's queued work, so the clock read next covers the whole step."""
        if self.cuda:
            torch.cuda.synchronize(self.torch)

    def barrier(self) -> None:
        """Finish this rank's queued work, then wait for every rank (NCCL on this GPU)."""
        if self.cuda:
            self.finish()
            dist.barrier(device_ids=[self.rank])
        else:
            dist.barrier()
