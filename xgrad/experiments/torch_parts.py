"""Pieces the torch experiments share; torch is imported inside, only in worker processes.

The experiments reach the torch backend through the registry (``get_backend("torch")``)
and import torch itself only in the functions that run in the spawned ranks, so
``import xgrad.experiments...`` stays free of torch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from xgrad.experiments.link import SimulatedLink
from xgrad.reference.clock import LinkModel

__all__ = ["linked_hook", "median_seconds", "mlp", "spawn", "torch_backend"]


def torch_backend() -> Any:
    """The torch backend package, found by name in the registry."""
    from xgrad.backend import get_backend

    return get_backend("torch")


def spawn(fn: Callable[..., Any], world: int, args: tuple[Any, ...], timeout: float) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks, one thread each."""
    return list(torch_backend().spawn(fn, world, args=args, timeout=timeout, num_threads=1))


def mlp(width: int, layers: int, seed: int) -> Any:
    """``layers`` Linear(width, width) + Tanh blocks, seeded the same on every rank."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods)


def median_seconds(fn: Callable[[], Any], warmup: int, steps: int) -> float:
    """Median wall time of ``fn`` over ``steps`` calls after ``warmup`` untimed ones; the
    ranks meet at a barrier before each call so that one rank's lag is not timed."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Held:
    """A reduction that is done when both the real allreduce and the link's time are."""

    def __init__(self, work: Any, finish: float) -> None:
        self._work = work
        self._finish = finish

    def wait(self) -> Any:
        out = self._work.wait()
        delay = self._finish - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return out


def linked_hook(link: SimulatedLink | None) -> Callable[[Any], Any]:
    """A hook factory for ``ddp.register_hook(factory(ddp.comm))``: DDP's averaging
    allreduce, and with a simulated link the bucket is also held until the link would
    have delivered it (booked when the bucket is launched, one message at a time)."""
    from xgrad.hooks import allreduce_hook

    def factory(comm: Any) -> Callable[[Any], Any]:
        inner = allreduce_hook(comm)

        def hook(bucket: Any) -> Any:
            if link is None:
                return inner(bucket)
            buf = bucket.buffer()
            finish = link.reserve(buf.numel() * buf.element_size())
            return _Held(inner(bucket), finish)

        return hook

    return factory


def make_link(kind: str, alpha: float, beta: float, world: int) -> SimulatedLink | None:
    """The simulated link for ``--link sim``; None for the real one."""
    return SimulatedLink(LinkModel(alpha, beta), world) if kind == "sim" else None
