"""``xgrad bench pipeline``: xgrad's pipeline runtime against torch.distributed.pipelining."""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from xgrad.tables import print_tables
from xgrad.torch_backend.memory import HeapMeter, PeakWatch
from xgrad.torch_backend.pipeline_bench_args import TORCH_SCHEDULES as TORCH_SCHEDULES
from xgrad.torch_backend.pipeline_bench_args import add_arguments as add_arguments
from xgrad.torch_backend.pipeline_bench_args import check_args

HELP = (
    "time per step of xgrad's pipeline runtime against torch.distributed.pipelining on the "
    "same model, stages and microbatches, for every schedule both implement (ratio with its "
    "95% interval, target <= 1.00 judged over several launches), the measured step "
    "time and bubble against the simulator fed measured per-action and per-message costs "
    "(targets: 10%, 3 points), and memory per stage"
)

#: the schedules with one stage per rank (torch's single-stage classes).
_SINGLE = ("gpipe", "1f1b")


def _stage(width: int, layers: int, device: Any) -> Any:
    from torch import nn

    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods).to(device)


def _sync(device: Any) -> None:
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _message_cost(rank: int, shape: tuple[int, ...], device: Any, rounds: int = 7) -> float:
    """Seconds one activation-sized message takes between ranks 0 and 1 (half the median
    round trip of a ping-pong), the same on every rank (broadcast from rank 0)."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(shape, device=device)
    trips = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        trips.append(time.perf_counter() - start)
    cost = torch.tensor([statistics.median(trips) / 2], dtype=torch.float64)
    dist.broadcast(cost, 0)
    return float(cost.item())


def _heap_peaks(
    runs: Mapping[str, Callable[[], None]], module: Any, device: Any, steps: int = 3
) -> dict[str, int]:
    """Per label, the most heap bytes in use above a step's start, polled during the step.

    The most over a few steps, since a poller can miss a short peak; the labels alternate
    as in the timed loop. The polling thread spins, so it runs only here, after the timing.
    """
    peaks = dict.fromkeys(runs, 0)
    with PeakWatch(HeapMeter()) as watch:
        for _ in range(steps):
            for label, fn in runs.items():
                _sync(device)
                peaks[label] = max(peaks[label], watch.measure(fn))
                module.zero_grad(set_to_none=True)
    return {f"{label}_heap_bytes": peak for label, peak in peaks.items()}


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as tp

    import xgrad.pipeline as xp
    from xgrad.torch_backend.pipeline import PipelineRuntime

    device = torch.device(
        f"cuda:{rank % max(1, torch.cuda.device_count())}" if cfg["backend"] == "nccl" else "cpu"
    )
    torch.manual_seed(rank)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g).to(device)
    y = torch.randn(cfg["batch"], cfg["width"], generator=g).to(device)
    m = cfg["microbatches"]
    loss_fn = torch.nn.functional.mse_loss
    out: dict[str, Any] = {
        "message": _message_cost(rank, (cfg["batch"] // m, cfg["width"]), device)
    }
    for name in cfg["schedules"]:
        schedule = xp.make(name, world, m)
        n = schedule.num_stages
        mine = schedule.stages_of(rank)
        # The same model whatever the schedule: chunks split a rank's layers between them.
        layers = max(1, cfg["layers"] // len(mine))
        modules = [_stage(cfg["width"], layers, device) for _ in mine]
        module = torch.nn.ModuleList(modules)
        first, last = 0 in mine, n - 1 in mine
        stages = [tp.PipelineStage(mod, s, n, device) for s, mod in zip(mine, modules, strict=True)]
        cls = getattr(tp, TORCH_SCHEDULES[name])
        theirs = cls(stages[0] if name in _SINGLE else stages, m, loss_fn=loss_fn)
        ours = PipelineRuntime(schedule, modules, loss_fn, checkpoint="never")

        def run_theirs(theirs: Any = theirs, first: bool = first, last: bool = last) -> None:
            if first:
                theirs.step(x, target=y, losses=[]) if last else theirs.step(x)
            elif last:
                theirs.step(target=y, losses=[])
            else:
                theirs.step()

        def run_ours(ours: Any = ours, first: bool = first, last: bool = last) -> None:
            ours.step(x if first else None, y if last else None)

        times: dict[str, list[float]] = {"torch": [], "xgrad": []}
        peaks: dict[str, int] = {}
        busy: list[float] = []
        all_records: list[Any] = []  # per timed step, this rank's actions
        stage_costs: dict[tuple[int, str], list[float]] = {}
        # The runtime's own time per action (between actions: its loop, posting receives),
        # and before its first action and after its last (to the closing barrier).
        dispatch: list[float] = []
        edges: dict[str, list[float]] = {"pre": [], "post": []}
        for _ in range(cfg["warmup"]):
            for fn in (run_theirs, run_ours):
                fn()
                module.zero_grad(set_to_none=True)
        pair = (("torch", run_theirs), ("xgrad", run_ours))
        for k in range(cfg["steps"]):
            # Alternate the two so drift in the machine's load hits both alike, and which
            # runs first in a pair too (torch first on even steps, xgrad on odd ones).
            for label, fn in pair if k % 2 == 0 else pair[::-1]:
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                stop = time.perf_counter()
                times[label].append(stop - start)
                module.zero_grad(set_to_none=True)
                if label == "xgrad":
                    recs = list(ours.records)
                    all_records.append([(str(r.action), r.start, r.end, r.waited) for r in recs])
                    # Compute time without the time blocked on a message.
                    busy.append(
                        sum(r.end - r.start - r.waited for r in recs if r.action.kind.is_compute)
                    )
                    # Every action's own time (compute, posting sends and receives) per stage.
                    for r in recs:
                        key = (r.action.stage, r.action.kind.value)
                        stage_costs.setdefault(key, []).append(r.end - r.start - r.waited)
                    gaps = sum(b.start - a.end for a, b in itertools.pairwise(recs))
                    dispatch.append(gaps / max(1, len(recs) - 1))
                    edges["pre"].append(recs[0].start - start)
                    edges["post"].append(stop - recs[-1].end)
        if device.type == "cuda":
            for label, fn in (("torch", run_theirs), ("xgrad", run_ours)):
                torch.cuda.reset_peak_memory_stats(device)
                fn()
                module.zero_grad(set_to_none=True)
                peaks[f"{label}_cuda_bytes"] = torch.cuda.max_memory_allocated(device)
        else:
            runs = {"torch": run_theirs, "xgrad": run_ours}
            peaks.update(_heap_peaks(runs, module, device))
        ours.peak_held_bytes = 0
        run_ours()
        module.zero_grad(set_to_none=True)
        peaks["xgrad_activation_bytes"] = ours.peak_held_bytes
        out[name] = {
            "torch": statistics.median(times["torch"]),
            "xgrad": statistics.median(times["xgrad"]),
            # Every timed step of both, in order: the report pairs them step by step.
            "torch_steps": times["torch"],
            "xgrad_steps": times["xgrad"],
            "busy": statistics.median(busy),
            # Each step's figures too, for the median over several launches' steps.
            "busy_steps": busy,
            "dispatch_steps": dispatch,
            "pre_steps": edges["pre"],
            "post_steps": edges["post"],
            # Every timed step's actions on the shared monotonic clock, for the latency of
            # each message as the runtime saw it; each action's own times, as sampled.
            "records": all_records,
            "costs": {k: statistics.mean(v) for k, v in stage_costs.items()},
            "samples": stage_costs,
            "dispatch": statistics.median(dispatch),
            "pre": statistics.median(edges["pre"]),
            "post": statistics.median(edges["post"]),
            "peaks": peaks,
        }
    dist.barrier()
    return out


def run(args: argparse.Namespace) -> int:
    from xgrad.torch_backend.pipeline_report import report
    from xgrad.torch_backend.spawn import spawn

    names = check_args(args)
    cfg = {
        k: getattr(args, k)
        for k in ("microbatches", "batch", "width", "layers", "steps", "warmup", "backend")
    }
    cfg["schedules"] = names
    launches = []
    for k in range(args.launches):
        # --steps is the total: each launch its share, the first ones one more if uneven.
        share = args.steps // args.launches + (k < args.steps % args.launches)
        launches.append(
            spawn(
                _worker,
                args.stages,
                args=(cfg | {"steps": share},),
                backend=args.backend,
                timeout=args.timeout,
                num_threads=args.threads if args.backend == "gloo" else None,
            )
        )
    text, tables = report(args, launches, names)
    print_tables(args, tables, text)
    return 0
