"""The rank worker the pipeline experiments share: one rank of a torch pipeline, timed and metered.

Each rank holds one stage (a few Linear + Tanh layers) and runs xgrad's pipeline runtime
(the torch backend's ``PipelineRuntime``) over loopback gloo.
Per configuration it reports the median step time, the busy time of its compute actions
as the runtime records them (a stage's forward and backward also wait there for the
activation or gradient they receive, so this over-counts work), the stage's own compute
measured alone (each microbatch's forward and backward with no pipeline and no messages,
the work a bubble is measured against), and the peak bytes of activations saved for the
backward pass (counted with autograd's saved-tensor hooks, so recomputation is seen too).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import xgrad.pipeline as xp
from xgrad.torch_backend.paper_parts import mlp
from xgrad.torch_backend.pipeline import PipelineRuntime

__all__ = ["pipeline_worker"]


class _SavedBytes:
    """Live and peak bytes of the tensors autograd saves for the backward pass."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def hooks(self) -> Any:
        meter = self

        class Held:
            __slots__ = ("nbytes", "tensor")

            def __init__(self, tensor: Any) -> None:
                self.tensor = tensor
                self.nbytes = tensor.numel() * tensor.element_size()
                meter.live += self.nbytes
                meter.peak = max(meter.peak, meter.live)

            def __del__(self) -> None:
                meter.live -= self.nbytes

        return torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.tensor)


def pipeline_worker(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Run every ``(schedule, m, checkpoint)`` of ``cfg["runs"]``; one dict per run."""
    runtime_cls = PipelineRuntime
    stage = mlp(cfg["width"], cfg["layers"], cfg["seed"] + rank)
    g = torch.Generator().manual_seed(cfg["seed"])
    x = torch.randn(cfg["batch"], cfg["width"], generator=g)
    y = torch.randn(cfg["batch"], cfg["width"], generator=g)
    first, last = rank == 0, rank == world - 1
    out = []
    for name, m, mode in cfg["runs"]:
        rt = runtime_cls(
            xp.make(name, world, m), [stage], torch.nn.functional.mse_loss, checkpoint=mode
        )
        meter = _SavedBytes()

        def step(rt: Any = rt) -> None:
            rt.step(x if first else None, y if last else None)
            stage.zero_grad(set_to_none=True)

        for _ in range(cfg["warmup"]):
            step()
        times, busy = [], []
        costs: dict[str, list[float]] = {}
        for _ in range(cfg["steps"]):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
            recs = [r for r in rt.records if r.action.kind.is_compute]
            # A pass waits for its inputs first: that time is not its cost.
            busy.append(sum(r.end - r.start - r.waited for r in recs))
            for r in recs:
                costs.setdefault(r.action.kind.value, []).append(r.end - r.start - r.waited)
        with meter.hooks():
            dist.barrier()
            step()
        # One rank at a time, so that the stages do not share the CPU while timed alone.
        for turn in range(world):
            dist.barrier()
            if turn == rank:
                forward, backward = _alone(stage, x.chunk(m)[0], last, m, cfg["steps"])
        out.append(
            {
                "time": statistics.median(times),
                "busy": statistics.median(busy),
                "costs": {k: statistics.median(v) for k, v in costs.items()},
                "forward": forward,
                "backward": backward,
                "saved_bytes": meter.peak,
            }
        )
        dist.barrier()
    return out


def _alone(stage: Any, x: Any, last: bool, m: int, steps: int) -> tuple[float, float]:
    """Median seconds of one microbatch's forward and backward through ``stage`` alone
    (with the loss on the last stage), as many times as a step runs them."""
    fwd, bwd = [], []
    for _ in range(steps * m):
        inp = x.detach().requires_grad_(True)
        start = time.perf_counter()
        y = stage(inp)
        out = torch.nn.functional.mse_loss(y, torch.zeros_like(y)) / m if last else y
        mid = time.perf_counter()
        if last:
            out.backward()
        else:
            out.backward(torch.ones_like(out))
        end = time.perf_counter()
        fwd.append(mid - start)
        bwd.append(end - mid)
    stage.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(bwd)
