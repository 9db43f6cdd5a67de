"""One cell of the fault matrix, as each rank runs it: a fault injected, what every rank saw.

A cell is (system, fault, where, world size). Every rank builds the system (xgrad's DDP or
the pipeline runtime), runs a clean step, then a step in which rank 1 raises, is killed
(SIGKILL) or freezes (SIGSTOP) at ``where``, then one more step. Each surviving rank
reports the error it raised (and the rank it names), how long it took, whether the step
after gave the clean step's gradients, and how long ``destroy_process_group()`` took.
"""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

#: the rank that fails in every cell.
FAULTY = 1

#: fast heartbeats, so a dead or frozen rank is named in about two seconds.
HEARTBEAT_ENV = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}


def named_origin(error: str, exc: BaseException | None = None) -> int | None:
    """The rank an error names as where it started (``rank N`` first), if any."""
    rank = getattr(exc, "rank", None)
    if isinstance(rank, int):
        return rank
    for pattern in (r"because rank (\d+)", r"\brank (\d+) in\b", r"\brank (\d+)"):
        found = re.search(pattern, error)
        if found:
            return int(found.group(1))
    return None


class Injector:
    """Raises, kills or freezes this process once, at one place of one step, on rank 1."""

    def __init__(self, rank: int, fault: str, where: str) -> None:
        self.rank, self.fault, self.where = rank, fault, where
        self.step = 0

    def __call__(self, here: str) -> None:
        if self.rank != FAULTY or self.step != 1 or here != self.where:
            return
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        raise RuntimeError(f"injected fault in {here}")


def _ddp_system(rank: int, world: int, inject: Injector, timeout: float) -> Any:
    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    ddp = DistributedDataParallel(model, timeout=timeout)

    def hook(
        state: Any, bucket: torch.distributed.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        inject("comm hook")
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)

    def backward_hook(grad: Any) -> Any:
        inject("backward hook")
        return grad

    model[0].register_forward_pre_hook(lambda m, a: inject("forward"))
    last = model[3]
    assert isinstance(last, nn.Linear)
    last.weight.register_hook(backward_hook)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 6, generator=g)

    def before_ddp(grad: Any) -> Any:
        inject("before DDP")  # on the output: the backward raises before any DDP hook runs
        return grad

    def step() -> list[Any]:
        model.zero_grad()
        out = ddp(x)
        out.register_hook(before_ddp)
        out.square().mean().backward()
        return [torch.clone(p.grad) if p.grad is not None else p * 0 for p in model.parameters()]

    return step


def _pipeline_system(rank: int, world: int, inject: Injector, timeout: float) -> Any:
    import torch
    from torch import nn

    from xgrad.pipeline import gpipe
    from xgrad.torch_backend.pipeline import PipelineRuntime

    torch.manual_seed(rank)
    part = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    part.register_forward_pre_hook(lambda m, a: inject("forward"))
    runtime = PipelineRuntime(gpipe(world, 2), [part], nn.functional.mse_loss, timeout=timeout)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)

    def step() -> list[Any]:
        part.zero_grad()
        runtime.step(x if rank == 0 else None, y if rank == world - 1 else None)
        return [torch.clone(p.grad) if p.grad is not None else p * 0 for p in part.parameters()]

    return step


SYSTEMS = {"ddp": _ddp_system, "pipeline": _pipeline_system}


def run_cell(rank: int, world: int, system: str, fault: str, where: str, timeout: float) -> dict:
    """What this rank saw in the cell (run in each process of a fresh group)."""
    import warnings

    import torch
    import torch.distributed as dist

    inject = Injector(rank, fault, where)
    step = SYSTEMS[system](rank, world, inject, timeout)
    # Two clean steps: the DDP rebuilds its buckets once, at the second, and gloo may sum a
    # bucket of another size in another order (3 ranks), so the step to compare with is
    # the second; the next step after the fault must then equal it bit for bit.
    step()
    clean = step()
    dist.barrier()
    inject.step = 1
    out: dict[str, Any] = {"error": "", "origin": None}
    start = time.monotonic()
    try:
        step()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        out["origin"] = named_origin(out["error"], exc)
    out["seconds"] = time.monotonic() - start
    inject.step = 2
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            again = step()
            out["next"] = all(torch.equal(a, b) for a, b in zip(again, clean, strict=True))
        except Exception as exc:
            # With a rank gone, the next step must raise the same named error, promptly.
            text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            out["next"] = fault != "raise" and named_origin(text, exc) == FAULTY
            out["next_error"] = text
    out["next_seconds"] = time.monotonic() - start
    start = time.monotonic()
    dist.destroy_process_group()
    out["destroy_seconds"] = time.monotonic() - start
    return out
