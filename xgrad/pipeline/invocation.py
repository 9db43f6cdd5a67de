"""Fairscale's invocation model: partitions placed on ranks, each invoked in a global order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "Invocation",
    "Location",
    "chain",
    "dag",
    "partitions_of",
    "placement_of",
    "sources_of",
]


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

    ``inputs`` makes the invocations a DAG (fairscale's full model): the orders of the
    invocations whose outputs this one takes, in order (a skip connection adds an earlier
    one); empty means the previous invocation (a chain). ``source`` is then the partition
    of ``inputs[0]`` and ``dest`` that of the first invocation consuming this one. An
    invocation with several inputs is called with the tuple of their outputs.
    """

    order: int
    this: Location
    source: Location | None
    dest: Location | None
    inputs: tuple[int, ...] = ()


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


def dag(
    locations: Sequence[Location | tuple[int, int]], inputs: Sequence[Sequence[int]]
) -> tuple[Invocation, ...]:
    """Invocations of partitions ``locations`` where invocation k takes the outputs of the
    invocations ``inputs[k]`` (``inputs[0]`` empty: it reads the model input).

    Example:
        >>> inv = dag([(0, 0), (1, 0), (0, 1)], [(), (0,), (1, 0)])  # 0 skips to 2
        >>> sources_of(inv)
        ((), (0,), (1, 0))
    """
    locs = [loc if isinstance(loc, Location) else Location(*loc) for loc in locations]
    if len(inputs) != len(locs):
        raise ValueError(f"inputs has {len(inputs)} entries for {len(locs)} locations")
    if locs and tuple(inputs[0]):
        raise ValueError(
            f"invocation 0 reads the model input: inputs[0] must be (), got {tuple(inputs[0])}"
        )
    for k, ins in enumerate(inputs):
        if k > 0:
            _check_inputs(k, tuple(ins))
    consumers: dict[int, list[int]] = {}
    for k, ins in enumerate(inputs):
        for i in ins:
            consumers.setdefault(i, []).append(k)
    return tuple(
        Invocation(
            k,
            loc,
            locs[inputs[k][0]] if inputs[k] else None,
            locs[min(consumers[k])] if k in consumers else None,
            tuple(inputs[k]) if k > 0 else (),
        )
        for k, loc in enumerate(locs)
    )


def _check_inputs(k: int, ins: tuple[int, ...]) -> None:
    """Invocation ``k`` may take only distinct earlier invocations (an index past the end
    raised a bare IndexError in :func:`dag`, and a negative one read from the end)."""
    if len(set(ins)) != len(ins) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < k for i in ins
    ):
        raise ValueError(f"invocation {k}: inputs {ins} must be distinct earlier orders 0..{k - 1}")


def _check_dag(ordered: list[Invocation]) -> None:
    n = len(ordered)
    consumed: set[int] = set()
    for i, inv in enumerate(ordered):
        ins = inv.inputs or ((i - 1,) if i > 0 else ())
        if i == 0 and inv.inputs:
            raise ValueError(f"invocation 0 reads the model input; got inputs {inv.inputs}")
        if i > 0:
            _check_inputs(i, tuple(ins))
        want = ordered[ins[0]].this if ins else None
        if inv.source != want:
            raise ValueError(
                f"invocation {i}: source is {inv.source}, but its first input, invocation "
                f"{ins[0] if ins else None}, runs {want}"
            )
        consumed.update(ins)
    for i in range(n - 1):
        if i not in consumed:
            raise ValueError(
                f"invocation {i}'s output is used by no later invocation (only the last, "
                f"{n - 1}, may end the model)"
            )
    for i, inv in enumerate(ordered):
        users = [j for j, x in enumerate(ordered) if i in (x.inputs or ((j - 1,) if j else ()))]
        want = ordered[min(users)].this if users else None
        if inv.dest != want:
            raise ValueError(
                f"invocation {i}: dest is {inv.dest}, but its first consumer runs {want}"
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
    if any(inv.inputs for inv in ordered):
        _check_dag(ordered)
        ranks = {inv.this.stage for inv in ordered}
        if ranks != set(range(len(ranks))):
            raise ValueError(f"ranks used by the invocations must be 0..n-1, got {sorted(ranks)}")
        return ordered
    for i, inv in enumerate(ordered):
        want_source = ordered[i - 1].this if i > 0 else None
        want_dest = ordered[i + 1].this if i + 1 < len(ordered) else None
        if inv.source != want_source:
            raise ValueError(
                f"invocation {i}: source is {inv.source}, but invocation {i - 1} runs "
                f"{want_source} (invocations form one chain in order; give inputs for a DAG)"
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


def sources_of(invocations: Sequence[Invocation]) -> tuple[tuple[int, ...], ...]:
    """Virtual stage -> the stages whose outputs it takes (``()`` for stage 0)."""
    return tuple(
        inv.inputs or ((inv.order - 1,) if inv.order else ()) for inv in _checked(invocations)
    )


def partitions_of(invocations: Sequence[Invocation]) -> tuple[Location, ...]:
    """Virtual stage -> the partition it invokes (what a runtime calls at that stage)."""
    return tuple(inv.this for inv in _checked(invocations))
