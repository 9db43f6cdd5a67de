"""Fairscale's invocation model: partitions placed on ranks, each invoked in a global order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Invocation", "Location", "chain", "partitions_of", "placement_of"]


@dataclass(frozen=True, order=True)
class Location:
    """Where a partition lives: pipeline rank ``stage`` (fairscale's word), slot ``index`` on it."""

    stage: int
    index: int


class Invocation(NamedTuple):
    """The ``order``-th call in the model's forward: partition ``this``, fed by ``source``.

    ``source`` is ``None`` for the first invocation (it reads the model input) and ``dest``
    is ``None`` for the last (its output goes to the loss). A partition invoked twice (a
    shared embedding, a reused block) appears in two invocations with the same ``this``;
    its gradient is the sum over both. Each invocation is one virtual stage of a schedule:
    stage ``order`` runs on rank ``this.stage``.
    """

    order: int
    this: Location
    source: Location | None
    dest: Location | None


def chain(locations: Sequence[Location | tuple[int, int]]) -> tuple[Invocation, ...]:
    """The invocations of a model that calls ``locations`` one after another.

    Example:
        >>> inv = chain([(0, 0), (1, 0), (0, 0)])  # rank 0's partition runs twice
        >>> placement_of(inv)
        (0, 1, 0)
    """
    locs = [loc if isinstance(loc, Location) else Location(*loc) for loc in locations]
    return tuple(
        Invocation(
            i,
            loc,
            locs[i - 1] if i > 0 else None,
            locs[i + 1] if i + 1 < len(locs) else None,
        )
        for i, loc in enumerate(locs)
    )


def _checked(invocations: Sequence[Invocation]) -> list[Invocation]:
    if not invocations:
        raise ValueError("invocations must not be empty, got ()")
    ordered = sorted(invocations, key=lambda inv: inv.order)
    for i, inv in enumerate(ordered):
        if not isinstance(inv, Invocation):
            raise TypeError(f"invocations[{i}]: expected an Invocation, got {inv!r}")
        if inv.order != i:
            orders = [x.order for x in ordered]
            raise ValueError(f"invocation orders must be 0..{len(ordered) - 1}, got {orders}")
        if inv.this.stage < 0 or inv.this.index < 0:
            raise ValueError(f"invocation {i}: location {inv.this} must be non-negative")
        want_source = ordered[i - 1].this if i > 0 else None
        want_dest = ordered[i + 1].this if i + 1 < len(ordered) else None
        if inv.source != want_source:
            raise ValueError(
                f"invocation {i}: source is {inv.source}, but invocation {i - 1} runs "
                f"{want_source} (invocations form one chain in order)"
            )
        if inv.dest != want_dest:
            raise ValueError(
                f"invocation {i}: dest is {inv.dest}, but invocation {i + 1} runs {want_dest}"
            )
    ranks = {inv.this.stage for inv in ordered}
    if ranks != set(range(len(ranks))):
        raise ValueError(f"ranks used by the invocations must be 0..n-1, got {sorted(ranks)}")
    return ordered


def placement_of(invocations: Sequence[Invocation]) -> tuple[int, ...]:
    """Virtual stage -> rank, for :class:`~xgrad.pipeline.Schedule` and the generators."""
    return tuple(inv.this.stage for inv in _checked(invocations))


def partitions_of(invocations: Sequence[Invocation]) -> tuple[Location, ...]:
    """Virtual stage -> the partition it invokes (what a runtime calls at that stage)."""
    return tuple(inv.this for inv in _checked(invocations))
