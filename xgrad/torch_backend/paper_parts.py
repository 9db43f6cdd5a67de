"""Pieces the torch experiments' rank workers share: a seeded MLP, a barrier-timed median,
and DDP hooks that hold each bucket for the simulated link's time.

They live in the backend (not in :mod:`xgrad.experiments`) because they use torch, and the
experiments reach torch only through the registry; the link model itself is the core's
:mod:`xgrad.link`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xgrad.hooks import allreduce_hook
from xgrad.link import SimulatedLink

__all__ = ["linked_hook", "median_seconds", "mlp"]


def mlp(width: int, layers: int, seed: int) -> nn.Sequential:
    """``layers`` Linear(width, width) + Tanh blocks, seeded the same on every rank."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods)


def median_seconds(fn: Callable[[], Any], warmup: int, steps: int) -> float:
    """Median wall time of ``fn`` over ``steps`` calls after ``warmup`` untimed ones; the
    ranks meet at a barrier before each call so that one rank's lag is not timed."""
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
