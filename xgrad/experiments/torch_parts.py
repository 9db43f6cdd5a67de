"""Pieces the torch experiments share: the torch backend from the registry, and spawning.

The experiments reach the torch backend through the registry (``get_backend("torch")``);
the per-rank workers they spawn live in the backend (``xgrad.torch_backend.paper_*``), so
``import xgrad.experiments...`` stays free of torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["spawn", "torch_backend"]


def torch_backend() -> Any:
    """The torch backend package, found by name in the registry."""
    from xgrad.backend import get_backend

    return get_backend("torch")


def spawn(fn: Callable[..., Any], world: int, args: tuple[Any, ...], timeout: float) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks, one thread each."""
    return list(torch_backend().spawn(fn, world, args=args, timeout=timeout, num_threads=1))
