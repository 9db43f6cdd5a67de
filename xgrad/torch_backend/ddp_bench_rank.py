"""What each rank of ``xgrad bench ddp`` runs: both DDPs and the bare model, step by step.

Each launch spawns the ranks with :func:`bench_rank`, which builds every case (model,
``find_unused_parameters``, ``join()``), constructs xgrad's DDP, PyTorch's and the bare
model on it (construction measured), warms them up, then alternates their steps so that
load on the machine hits all alike, timing each step's wall and CPU time, and measures
each DDP's peak memory of one step and xgrad's time per gradient hook. It returns one
:class:`~xgrad.torch_backend.ddp_bench_rows.CaseSample` per case (as a dict). Kept apart
from the command (:mod:`.bench`: its options, the launches, the table) because this runs
in the spawned processes and measures, while that part only plans and reports.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import itertools
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from xgrad.torch_backend.ddp import DistributedDataParallel
from xgrad.torch_backend.ddp_bench_device import BenchDevice, CudaMeter, step_peak
from xgrad.torch_backend.ddp_bench_rows import CaseSample
from xgrad.torch_backend.memory import HeapMeter

__all__ = ["bench_rank"]


class _Side:
    """One implementation under test: its model copy, DDP wrapper and optimizer."""

    def __init__(self, wrap: Callable[[Any], Any], base: Any, meter: HeapMeter | CudaMeter) -> None:
        self.model = copy.deepcopy(base)
        # Garbage of the last case is freed now, not by a collection that happens to run
        # inside one side's construction (which read as that side taking less).
        gc.collect()
        before = meter.live()
        self.ddp = wrap(self.model)
        # Construction can free more than it takes (a collection, the allocator trimming):
        # what DDP holds is never negative.
        self.construction = max(meter.live() - before, 0)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.peak = 0

    def step(self, x: Any, y: Any, sample: Callable[[], None] | None = None) -> None:
        self.opt.zero_grad()
        out = self.ddp(x)
        if sample is not None:
            sample()
        ((out - y) ** 2).mean().backward()
        if sample is not None:
            sample()
        self.opt.step()


#: the order of the sides in even and odd steps (see :func:`bench_rank`).
_TURNS = (("xgrad", "torch", "local"), ("torch", "xgrad", "local"))


def _factories(find_unused: bool, device: BenchDevice) -> dict[str, Callable[[Any], Any]]:
    kw = {"find_unused_parameters": find_unused, **device.ddp_kwargs}
    return {
        "xgrad": functools.partial(DistributedDataParallel, **kw),
        "torch": functools.partial(TorchDDP, **kw),
        "local": lambda model: model,  # the bare model: what a step costs without DDP
    }


def bench_rank(rank: int, world: int, settings: dict[str, Any]) -> list[dict[str, Any]]:
    device = BenchDevice(settings["device"], rank)
    meter = device.meter()
    # Both implementations allocate once per process on first use (gloo's pair buffers,
    # PyTorch's logger, pickling tables): pay that here, outside every measurement.
    base, x, y = device.build("mlp", "tiny")
    for key, make in _factories(True, device).items():
        if key == "local":
            continue
        _Side(make, base, meter).step(x, y)
    rows = []
    cases = itertools.product(settings["models"], settings["find_unused"], settings["join"])
    for case, (name, find_unused, join) in enumerate(cases):
        base, x, y = device.build(name, settings["scale"])
        factories = _factories(find_unused, device)
        # Constructed in alternating order, so neither is always first on a fresh heap.
        order = ["xgrad", "torch", "local"] if case % 2 == 0 else ["torch", "xgrad", "local"]
        sides = {key: _Side(factories[key], base, meter) for key in order}
        with contextlib.ExitStack() as joined:
            if join:  # each DDP's own join(): xgrad's and PyTorch's, entered for the case
                for key in ("xgrad", "torch"):
                    joined.enter_context(sides[key].ddp.join())
            for side in sides.values():
                for _ in range(settings["warmup"]):
                    side.step(x, y)
            device.barrier()
            # Alternate step by step (each step is synchronised across ranks by its
            # allreduce), so load on the machine hits both alike: x t l, t x l, x t l...
            # No side ever follows itself (a side right after its own step finds its
            # tensors still in cache), and each follows each other side equally often.
            for i in range(settings["rounds"] * settings["iters"]):
                for key in _TURNS[i % 2]:
                    side = sides[key]
                    start, cpu = time.perf_counter(), time.process_time()
                    side.step(x, y)
                    device.finish()  # the GPU's queued work (CPU: nothing)
                    side.times.append(time.perf_counter() - start)
                    side.cpu.append(time.process_time() - cpu)
            for key in ("xgrad", "torch"):
                side = sides[key]
                side.peak = step_peak(meter, side.opt.zero_grad, functools.partial(side.step, x, y))
            hook = _hook_seconds(sides["xgrad"], x, y)
            params = list(base.parameters())
            rows.append(
                asdict(
                    CaseSample(
                        model=name,
                        find_unused=find_unused,
                        world=world,
                        tensors=len(params),
                        parameters=sum(p.numel() for p in params),
                        xgrad_times=tuple(sides["xgrad"].times),
                        torch_times=tuple(sides["torch"].times),
                        local_times=tuple(sides["local"].times),
                        xgrad_cpu=tuple(sides["xgrad"].cpu),
                        torch_cpu=tuple(sides["torch"].cpu),
                        xgrad_memory=sides["xgrad"].construction + sides["xgrad"].peak,
                        torch_memory=sides["torch"].construction + sides["torch"].peak,
                        hook_seconds=hook,
                        join=join,
                    )
                )
            )
        del sides
        torch.manual_seed(0)
    return rows


def _hook_seconds(side: _Side, x: Any, y: Any) -> float:
    """Wall time of xgrad's reducer work per gradient, from its hooks, over three steps.

    Gradients whose hooks only log their arrival (:mod:`.ddp_arrivals`) are marked in
    one ``mark_many`` call from the next Python hook: the total time in ``mark_ready``
    and ``mark_many`` (launches included) divided by the gradients they marked.
    """
    reducer = side.ddp.reducer
    single, many = reducer.mark_ready, reducer.mark_many
    spent = [0.0, 0]

    def timed_single(index: int, grad: Any) -> None:
        start = time.perf_counter()
        single(index, grad)
        spent[0] += time.perf_counter() - start
        spent[1] += 1

    def timed_many(indices: Any, grads: Any) -> None:
        start = time.perf_counter()
        many(indices, grads)
        spent[0] += time.perf_counter() - start
        spent[1] += len(indices)

    reducer.mark_ready, reducer.mark_many = timed_single, timed_many
    try:
        for _ in range(3):
            side.step(x, y)
    finally:
        del reducer.mark_ready, reducer.mark_many
    return spent[0] / max(spent[1], 1)
