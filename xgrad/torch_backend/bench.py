"""``xgrad bench ddp``: xgrad's DDP against PyTorch's, same model and data, ratios printed.

Both run in the same processes of one gloo group, alternating step by step so that
load on the machine hits both alike, and each case runs in several launches of fresh
processes (``--launches``), since what one launch draws moves the ratio more than its
interval says. Reported per model and per ``find_unused_parameters`` setting (and with
``--join`` inside each side's own ``join()``, inputs even: what ``join()`` costs a step
while no rank has joined): median step time of each side (zero_grad, forward, backward,
optimizer step); the time ratio, the median of the per-turn ratios xgrad step
/ PyTorch step with its 95% interval and each launch's own, judged launch by launch
(``xgrad.bench_stats``); the CPU of the whole process
per step (every thread), since a faster step may be bought with CPU; memory (bytes allocated by
DDP's construction plus the peak of one step above its start, from the C allocator,
polled by a thread during the step), and xgrad's Python cost per gradient hook.
``--device cuda`` runs the same on NCCL, rank r on ``cuda:r`` (:mod:`.ddp_bench_device`)."""

from __future__ import annotations

import argparse
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

from xgrad.bench_stats import interval_label, rule
from xgrad.tables import add_table_outputs, print_tables
from xgrad.torch_backend.ddp import DistributedDataParallel
from xgrad.torch_backend.ddp_bench_device import (
    BACKENDS,
    DEVICES,
    LABELS,
    BenchDevice,
    CudaMeter,
    check_worlds,
    step_peak,
)
from xgrad.torch_backend.ddp_bench_models import MODELS
from xgrad.torch_backend.ddp_bench_rows import CaseSample, pooled, rows_table, table
from xgrad.torch_backend.memory import HeapMeter
from xgrad.torch_backend.spawn import spawn

HELP = "xgrad's DDP vs PyTorch's DDP (gloo, CPU; or NCCL, CUDA): step time and memory ratios"

#: timed (rounds, iterations per round) and warm-up steps when not given, per scale.
_STEPS = {"full": (18, 10, 4), "tiny": (2, 3, 1)}

#: launches of fresh processes per case when not given, per scale; the rounds are split
#: between them (``xgrad.bench_stats``: why one launch cannot judge a row, and why six
#: launches are the fewest whose medians get an interval of their own).
_LAUNCHES = {"full": 6, "tiny": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="ranks")
    parser.add_argument(
        "--wide-world-size",
        type=int,
        help="also run the first model at this world size (0: no such row; "
        "default 4 on cpu, 0 on cuda)",
    )
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}"
    )
    parser.add_argument(
        "--rounds", type=int, help="alternations per case, over all launches (full 18, tiny 2)"
    )
    parser.add_argument(
        "--launches",
        type=int,
        help="runs of fresh processes per case, the rounds split between them (full 6, tiny 1); "
        "from 6 on the verdict judges the interval of the launches' medians",
    )
    parser.add_argument(
        "--iters", type=int, help="timed steps per round and side (full 10, tiny 3)"
    )
    parser.add_argument("--warmup", type=int, help="untimed steps per side (full 4, tiny 1)")
    parser.add_argument(
        "--scale", choices=("full", "tiny"), default="full", help="tiny: a smoke run"
    )
    parser.add_argument(
        "--find-unused",
        choices=("both", "no", "yes"),
        default="both",
        help="the find_unused_parameters settings to run (the wide row: no)",
    )
    parser.add_argument(
        "--join",
        choices=("no", "yes", "both"),
        default="no",
        help="run both sides' steps inside their DDP's join() (even inputs: what join() "
        "costs a step while no rank has joined); rows 'model, join' (the wide row: no)",
    )
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cuda: NCCL, rank r on cuda:r (--world-size at most the GPUs; 1 allowed)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the run")
    add_table_outputs(parser, "the rows (seconds, bytes, ratios)")


def run(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if not models:
        raise ValueError(f"--models {args.models!r} names no model; expected some of {MODELS}")
    if unknown:
        raise ValueError(f"--models: unknown model(s) {unknown}; expected some of {MODELS}")
    world, wide_world = check_worlds(args.device, args.world_size, args.wide_world_size)
    for label, least in (
        ("rounds", 1),
        ("launches", 1),
        ("iters", 1),
        ("warmup", 0),
        ("threads", 1),
    ):
        value = getattr(args, label)
        if value is not None and value < least:
            raise ValueError(f"--{label.replace('_', '-')} must be at least {least}, got {value}")
    rounds, iters, warmup = _STEPS[args.scale]
    rounds = rounds if args.rounds is None else args.rounds
    launches = _LAUNCHES[args.scale] if args.launches is None else args.launches
    if launches > rounds:
        raise ValueError(
            f"--launches {launches} needs at least as many rounds to split, got --rounds {rounds}"
        )
    settings = {
        "models": models,
        "iters": iters if args.iters is None else args.iters,
        "warmup": warmup if args.warmup is None else args.warmup,
        "scale": args.scale,
        "device": args.device,
        "find_unused": {"both": (False, True), "no": (False,), "yes": (True,)}[args.find_unused],
        "join": {"both": (False, True), "no": (False,), "yes": (True,)}[args.join],
    }
    wide = settings | {"models": models[:1], "find_unused": (False,), "join": (False,)}
    runs = [(world, settings)]
    if wide_world:
        runs.append((wide_world, wide))
    samples: dict[tuple[int, tuple[str, bool, int], bool], list[CaseSample]] = {}
    # Launch after launch, every world size in each, so a slow spell of the machine
    # falls on one launch of many cases rather than on every launch of one case.
    for k in range(launches):
        share = {"rounds": rounds // launches + (k < rounds % launches)}
        for j, (world, case_settings) in enumerate(runs):
            for row in spawn(
                _bench,
                world,
                args=(case_settings | share,),
                backend=BACKENDS[args.device],
                timeout=args.timeout,
                num_threads=args.threads,
            )[0]:
                sample = CaseSample(**row)
                samples.setdefault((j, sample.case, sample.join), []).append(sample)
    results = [pooled(group) for group in samples.values()]
    steps = sorted({r.steps for r in results})
    turns = min((r.turns for r in results if r.turns), default=None)
    pooled_n = min((r.pooled_turns for r in results if r.pooled_turns), default=0)
    head = (
        f"xgrad DDP vs torch DDP: {LABELS[args.device]}, {args.threads} thread(s) per rank, "
        f"median of {'/'.join(map(str, steps))} timed steps per side over {launches} launch(es) of "
        "fresh processes (each step alternated with the other side and with the bare "
        "model); time ratio = median over those turns of xgrad step / torch step in the "
        f"same turn [{interval_label(pooled_n)} of that "
        f"median]; launches = each launch's own median; target: ratio <= 1.00, "
        f"{rule(launches, turns=turns)}; CPU ratio = median CPU of the whole "
        "process per xgrad step / per torch step; µs/grad = (DDP step - bare step) / tensors"
    )
    print_tables(args, [rows_table(results)], head + "\n" + table(results))
    return 0


# ---------------------------------------------------------------------- inside each rank


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


#: the order of the sides in even and odd steps (see ``_bench``).
_TURNS = (("xgrad", "torch", "local"), ("torch", "xgrad", "local"))


def _factories(find_unused: bool, device: BenchDevice) -> dict[str, Callable[[Any], Any]]:
    kw = {"find_unused_parameters": find_unused, **device.ddp_kwargs}
    return {
        "xgrad": functools.partial(DistributedDataParallel, **kw),
        "torch": functools.partial(TorchDDP, **kw),
        "local": lambda model: model,  # the bare model: what a step costs without DDP
    }


def _bench(rank: int, world: int, settings: dict[str, Any]) -> list[dict[str, Any]]:
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
