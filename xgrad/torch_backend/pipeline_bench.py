"""``xgrad bench pipeline``: xgrad's pipeline runtime against torch.distributed.pipelining."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from xgrad.torch_backend.memory import HeapMeter, PeakWatch

HELP = (
    "time per step of xgrad's pipeline runtime against PyTorch's ScheduleGPipe and "
    "Schedule1F1B on the same model, stages and microbatches (ratio, target <= 1.05), the "
    "measured bubble against the simulated one, and peak memory per stage"
)

#: xgrad schedule name -> torch.distributed.pipelining class name.
_TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", "-p", type=int, default=2, help="p: pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=int, default=8, help="m: microbatches")
    parser.add_argument("--batch", type=int, default=256, help="whole batch size")
    parser.add_argument("--width", type=int, default=512, help="hidden width")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers per stage")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default="gloo", help="gloo (CPU) or nccl (GPU)"
    )
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (CPU)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")


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
    module = _stage(cfg["width"], cfg["layers"], device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g).to(device)
    y = torch.randn(cfg["batch"], cfg["width"], generator=g).to(device)
    m = cfg["microbatches"]
    loss_fn = torch.nn.functional.mse_loss
    first, last = rank == 0, rank == world - 1
    out: dict[str, Any] = {}
    for name, cls in _TORCH.items():
        theirs = getattr(tp, cls)(tp.PipelineStage(module, rank, world, device), m, loss_fn=loss_fn)
        ours = PipelineRuntime(xp.make(name, world, m), [module], loss_fn, checkpoint="never")

        def run_theirs(theirs: Any = theirs) -> None:
            if first:
                theirs.step(x)
            elif last:
                theirs.step(target=y, losses=[])
            else:
                theirs.step()

        def run_ours(ours: Any = ours) -> None:
            ours.step(x if first else None, y if last else None)

        times: dict[str, list[float]] = {"torch": [], "xgrad": []}
        peaks: dict[str, int] = {}
        busy: list[float] = []
        stage_costs: dict[str, list[float]] = {}
        for _ in range(cfg["warmup"]):
            for fn in (run_theirs, run_ours):
                fn()
                module.zero_grad(set_to_none=True)
        for _ in range(cfg["steps"]):
            # Alternate the two so drift in the machine's load hits both alike.
            for label, fn in (("torch", run_theirs), ("xgrad", run_ours)):
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                times[label].append(time.perf_counter() - start)
                module.zero_grad(set_to_none=True)
                if label == "xgrad":
                    recs = [r for r in ours.records if r.action.kind.is_compute]
                    busy.append(sum(r.end - r.start for r in recs))
                    for r in recs:
                        stage_costs.setdefault(r.action.kind.value, []).append(r.end - r.start)
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
        ours.step(x if first else None, y if last else None)
        module.zero_grad(set_to_none=True)
        peaks["xgrad_activation_bytes"] = ours.peak_held_bytes
        out[name] = {
            "torch": statistics.median(times["torch"]),
            "xgrad": statistics.median(times["xgrad"]),
            "busy": statistics.median(busy),
            "costs": {k: statistics.median(v) for k, v in stage_costs.items()},
            "peaks": peaks,
        }
    dist.barrier()
    return out


def run(args: argparse.Namespace) -> int:
    import xgrad.pipeline as xp
    from xgrad.pipeline import Kind
    from xgrad.torch_backend.spawn import spawn

    p, m = args.stages, args.microbatches
    for label, value in (("stages", p), ("microbatches", m), ("steps", args.steps)):
        if value < 1:
            raise ValueError(f"--{label} must be >= 1, got {value}")
    if p < 2:
        raise ValueError(f"--stages must be >= 2 for a pipeline, got {p}")
    if args.batch % m:
        raise ValueError(f"--batch {args.batch} is not a multiple of --microbatches {m}")
    cfg = {
        k: getattr(args, k)
        for k in ("microbatches", "batch", "width", "layers", "steps", "warmup", "backend")
    }
    per_rank = spawn(
        _worker,
        p,
        args=(cfg,),
        backend=args.backend,
        timeout=args.timeout,
        num_threads=args.threads if args.backend == "gloo" else None,
    )
    print(
        f"pipeline bench: p={p} stages, m={m} microbatches, batch {args.batch}, width "
        f"{args.width}, {args.layers} layers per stage, {args.backend}, median of {args.steps} steps"
    )
    print(f"{'schedule':<8} {'torch s/step':>13} {'xgrad s/step':>13} {'ratio':>7}  target <= 1.05")
    worst = 0.0
    for name in _TORCH:
        t_torch = max(r[name]["torch"] for r in per_rank)
        t_ours = max(r[name]["xgrad"] for r in per_rank)
        ratio = t_ours / t_torch
        worst = max(worst, ratio)
        print(
            f"{name:<8} {t_torch:>13.5f} {t_ours:>13.5f} {ratio:>7.3f}  {'ok' if ratio <= 1.05 else 'MISSED'}"
        )
    print()
    print(
        "bubble fraction (of total time): measured (xgrad) / simulated with measured costs / equal costs"
    )
    for name in _TORCH:
        step = max(r[name]["xgrad"] for r in per_rank)
        measured = 1.0 - sum(r[name]["busy"] for r in per_rank) / (p * step)
        # Stage s runs on rank s: its measured median cost per kind.
        costs = {
            (r, Kind(k)): c for r, res in enumerate(per_rank) for k, c in res[name]["costs"].items()
        }
        sched = xp.make(name, p, m)
        sim = xp.simulate(sched, lambda a, costs=costs: costs[(a.stage, a.kind)])
        equal = xp.simulate(sched)
        print(
            f"{name:<8} measured {measured:.3f}  simulated {sim.bubble_fraction:.3f}  "
            f"equal-cost {equal.bubble_fraction:.3f}  ((p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.3f})"
        )
    print()
    print(f"peak memory per stage, MiB ({_memory_legend(args.backend)})")
    for r, res in enumerate(per_rank):
        cells = []
        for name in _TORCH:
            # In the order measured: torch, then xgrad, then xgrad's own count.
            peaks = res[name]["peaks"]
            cells.append(
                f"{name} "
                + ", ".join(
                    f"{k.replace('_bytes', '')}={v / 2**20:.2f} MiB" for k, v in peaks.items()
                )
            )
        print(f"stage {r}: " + " | ".join(cells))
    return 0


def _memory_legend(backend: str) -> str:
    """What each figure of the memory section is."""
    own = "xgrad_activation: xgrad's own count of microbatch activations and their grads held"
    if backend == "nccl":
        return f"cuda: torch.cuda.max_memory_allocated over one step; {own}"
    return (
        f"heap: C heap in use above the step's start ({HeapMeter().source}), peak polled by "
        f"a thread during the step, max of 3 steps; {own}"
    )
