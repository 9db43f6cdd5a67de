"""Autograd functions whose backward raises on purpose, for the failure tests.

A :func:`failing_function`'s node is named after the class (``BoomBackward`` for
``failing_function("Boom", ...)``), so the tests can check that an error names the node
where it started. :class:`Raising` raises once, when armed (a stage's backward failing in
a chosen microbatch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def failing_function(
    name: str, error: Callable[[], BaseException], before: Callable[[], None] | None = None
) -> Any:
    """A ``torch.autograd.Function`` class ``name``: identity forward, backward raises ``error()``.

    ``before`` runs first in the backward (e.g. to note when the failure happened).
    """

    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if before is not None:
            before()
        raise error()

    body = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), body)


class Raising(torch.autograd.Function):
    """Identity whose backward raises ``ValueError("bad gradient")`` once when armed."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if Raising.armed:
            Raising.armed = False
            raise ValueError("bad gradient")
        return g
