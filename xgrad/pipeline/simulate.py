"""Cost simulation of a schedule: timeline, step time, bubble fraction, activations held."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from xgrad.pipeline.actions import Action, Kind
from xgrad.pipeline.schedule import Schedule, format_grid
from xgrad.pipeline.validate import check_ranks

__all__ = [
    "DEFAULT_COSTS",
    "Simulation",
    "Span",
    "checked_cost",
    "dependencies",
    "peak_held",
    "simulate",
    "summarize",
]

#: Equal costs in the zero-bubble paper's sense: forward, input-backward and weight-backward
#: take one unit each, so a full backward (input and weight together) takes two.
DEFAULT_COSTS: Mapping[Kind, float] = {
    Kind.FORWARD: 1.0,
    Kind.BACKWARD_INPUT: 1.0,
    Kind.BACKWARD_WEIGHT: 1.0,
    Kind.BACKWARD: 2.0,
}

Costs = Mapping[Kind, float] | Callable[[Action], float]


@dataclass(frozen=True)
class Span:
    """One compute action on the timeline."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` found.

    Attributes:
        spans: every compute action with its start and end, per rank in execution order.
        makespan: one isolated step, from the first start to the last end.
        step_time: the time of one step when steps run back to back with nothing
            synchronising them: the longest span of one rank from its first start to its last
            end (the zero-bubble paper's measure; a rank starts its next step as soon as its
            own part of this one is done).
        busy: per rank, the summed cost of its actions.
        bubble_fraction: idle share of total time, ``1 - sum(busy) / (p * step_time)``.
        peak_held: per rank, the most (stage, microbatch) activation sets held at once (from
            the forward until the backward that frees them: B, or W when backward is split).
    """

    spans: tuple[tuple[Span, ...], ...]
    makespan: float
    step_time: float
    busy: tuple[float, ...]
    bubble_fraction: float
    peak_held: tuple[int, ...]

    def summary(self) -> str:
        """The figures as a few labelled lines."""
        held = ", ".join(str(h) for h in self.peak_held)
        # Costs of zero leave a step of no time, whose idle share is 0/0 (it printed 0).
        bubble = f"{self.bubble_fraction:.4f}" if self.step_time > 0 else "undefined (no time)"
        return (
            f"step time (back to back): {self.step_time:g}\n"
            f"makespan (one step alone): {self.makespan:g}\n"
            f"bubble fraction (of total time): {bubble}\n"
            f"peak activations held per rank, one per (stage, microbatch): {held}\n"
        )

    def grid(self, quantum: float | None = None) -> str:
        """The timeline as a time × rank grid; each row is ``quantum`` long, idle rows left
        blank. The default is the longest row that every start and end falls on (the
        shortest action that takes time, or a half, a third... of it: with F = 1 and B =
        1.5, half a unit), so each action has rows of its own; where none does (or
        ``quantum`` is given), actions that share a row are shown there together, ``0B1/0F3``:
        a row held one action only, and the one drawn over vanished from the picture.

        Raises:
            ValueError: ``quantum`` is not a finite number > 0, or no action takes time
                (zero costs: there is no timeline to draw, ``Schedule.grid`` shows the order).
        """
        all_spans = [s for spans in self.spans for s in spans]
        if quantum is not None and not 0.0 < quantum < math.inf:
            raise ValueError(f"quantum must be a finite number > 0, got {quantum!r}")
        if not all_spans:
            return ""
        lengths = [s.end - s.start for s in all_spans if s.end > s.start]
        if not lengths:
            raise ValueError(
                f"every one of the {len(all_spans)} actions takes 0 time (zero costs): the "
                "step has no length and no timeline to draw; the schedule's grid() shows "
                "each rank's order"
            )
        q = quantum or _row_length(all_spans, min(lengths))
        rows = max(round(self.makespan / q), 1)
        columns: list[list[str]] = []
        for spans in self.spans:
            col = [""] * rows
            for s in spans:
                first = round(s.start / q)
                for t in range(first, max(round(s.end / q), first + 1)):
                    t = min(t, rows - 1)  # an action of no time at the very end
                    label = str(s.action)
                    if col[t] and not col[t].endswith(label):
                        col[t] += "/" + label
                    elif not col[t]:
                        col[t] = label
            columns.append(col)
        return format_grid(columns, row_label="t")


#: the finest row :meth:`Simulation.grid` picks by itself: the shortest action over this.
_MAX_SPLIT = 12


def _row_length(spans: list[Span], shortest: float) -> float:
    """The longest row, ``shortest / k`` for k up to :data:`_MAX_SPLIT`, that every start
    and end is a whole number of (to a part in a million); ``shortest`` if none is."""
    times = [t for s in spans for t in (s.start, s.end)]
    for k in range(1, _MAX_SPLIT + 1):
        q = shortest / k
        if all(abs(t / q - round(t / q)) <= 1e-6 for t in times):
            return q
    return shortest


def dependencies(schedule: Schedule, action: Action) -> list[Action]:
    """The compute actions that must finish before compute ``action`` may start."""
    s, mb = action.stage, action.microbatch
    if action.kind is Kind.FORWARD:
        return [Action(t, Kind.FORWARD, mb) for t in schedule.sources(s)]
    if action.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        users = [Action(t, schedule.backward_kind(t, mb), mb) for t in schedule.consumers(s)]
        return [Action(s, Kind.FORWARD, mb), *users]
    if action.kind is Kind.BACKWARD_WEIGHT:
        return [Action(s, Kind.BACKWARD_INPUT, mb)]
    raise ValueError(f"dependencies are defined for compute actions, got {action}")


def peak_held(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, microbatch) activation sets held at once, in list order."""
    peaks = []
    for r in range(schedule.num_ranks):
        held = peak = 0
        for a in schedule.compute(r):
            if a.kind is Kind.FORWARD:
                held += 1
                peak = max(peak, held)
            elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
                held -= 1
        peaks.append(peak)
    return tuple(peaks)


def checked_cost(value: float, what: str) -> float:
    """``value`` as a float, refused unless finite and >= 0 (``what`` names it in the
    error): a negative cost or latency let a pass start before its input existed, NaN and
    infinity made the step time and the bubble fraction NaN."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {value!r}") from None
    if not 0.0 <= number < math.inf:
        raise ValueError(f"{what} must be >= 0 and finite, got {value!r}")
    return number


def _cost_fn(costs: Costs | None) -> Callable[[Action], float]:
    """The cost of each action, checked (``costs`` named as given: a table or a function)."""
    if costs is None:
        costs = DEFAULT_COSTS
    if callable(costs):
        fn = costs
        return lambda a: checked_cost(fn(a), f"costs({a})")
    table = dict(costs)
    for kind, value in table.items():
        name = kind.name if isinstance(kind, Kind) else repr(kind)
        checked_cost(value, f"costs[{name}]")

    def lookup(a: Action) -> float:
        if a.kind not in table:
            raise ValueError(f"costs has no entry for {a.kind.name} (action {a}); got {table}")
        return float(table[a.kind])

    return lookup


def simulate(
    schedule: Schedule, costs: Costs | None = None, *, comm_cost: float = 0.0
) -> Simulation:
    """Run the schedule on a virtual clock.

    Each rank runs its compute actions in order, each as soon as the rank is free and the
    actions it depends on are done (``comm_cost`` later when they ran on another rank).
    Sends and receives are taken as asynchronous and are not timed themselves. What a part
    of an overlapped pair (DualPipeV's ``OVERLAP_F_B``) sends leaves when the whole pair
    ends, as the lowered schedule sends it (:func:`~xgrad.pipeline.insert_comms`, torch's
    too) and both runtimes run it; before session 38 its forward's output left as that
    forward ended, and DualPipeV's step time came out short (54 against 51 at p = 4, m = 8,
    as :func:`~xgrad.pipeline.simulate_messages` and the runtimes have it).

    Args:
        schedule: any valid schedule (with or without explicit comms).
        costs: a cost per kind (default :data:`DEFAULT_COSTS`) or a function of the action
            (measured per-stage costs).
        comm_cost: latency added to a dependency that crosses ranks.

    Raises:
        ValueError: the schedule cannot finish (validate it for a drawn explanation), a
            cost or ``comm_cost`` is negative, NaN or infinite, or together they overflow.
        ScheduleError: a rank holds no stage (its idle time would count into the bubble
            of a schedule no runtime runs; :func:`~xgrad.pipeline.validate.check_ranks`).
    """
    check_ranks(schedule)
    cost = _cost_fn(costs)
    comm_cost = checked_cost(comm_cost, "comm_cost")
    p = schedule.num_ranks
    queues = [list(schedule.compute(r)) for r in range(p)]
    where = {a: r for r, q in enumerate(queues) for a in q}
    # a pair's parts -> its last part, whose end is when their outputs leave the rank
    leaves = {
        part: a.sub[-1]
        for acts in schedule.actions
        for a in acts
        if a.kind is Kind.OVERLAP_F_B
        for part in a.sub
    }
    end: dict[Action, float] = {}
    spans: list[list[Span]] = [[] for _ in range(p)]
    free = [0.0] * p
    heads = [0] * p
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for r in range(p):
            while heads[r] < len(queues[r]):
                a = queues[r][heads[r]]
                # a dependency on another rank: when its output arrives here
                deps = [
                    d if where.get(d) == r else leaves.get(d, d) for d in dependencies(schedule, a)
                ]
                if any(d not in end for d in deps):
                    break
                ready = max(
                    [end[d] + (comm_cost if where.get(d) != r else 0.0) for d in deps],
                    default=0.0,
                )
                start = max(free[r], ready)
                c = cost(a)
                end[a] = free[r] = start + c
                spans[r].append(Span(r, a, start, start + c))
                heads[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(queues[r][heads[r]]) for r in range(p) if heads[r] < len(queues[r])}
            raise ValueError(
                f"schedule {schedule.name!r} cannot finish; stuck heads per rank: {stuck}"
            )
    firsts = [sp[0].start for sp in spans if sp]
    lasts = [sp[-1].end for sp in spans if sp]
    if lasts and not max(lasts) < math.inf:  # each cost finite, their sum not
        raise ValueError(
            f"schedule {schedule.name!r}: the costs add up past the largest float "
            f"(a step of {sum(len(q) for q in queues)} actions); give smaller costs"
        )
    makespan = max(lasts) - min(firsts) if lasts else 0.0
    step_time = max((sp[-1].end - sp[0].start for sp in spans if sp), default=0.0)
    return summarize(schedule, spans, makespan, step_time)


def summarize(
    schedule: Schedule, spans: list[list[Span]], makespan: float, step_time: float
) -> Simulation:
    """The :class:`Simulation` of per-rank ``spans``: busy time per rank and the bubble
    (the idle share of ``p`` ranks over ``step_time``), shared by every simulator."""
    busy = tuple(sum(s.end - s.start for s in sp) for sp in spans)
    p = len(spans)
    bubble = 1.0 - sum(busy) / (p * step_time) if step_time > 0 else 0.0
    return Simulation(
        spans=tuple(tuple(sp) for sp in spans),
        makespan=makespan,
        step_time=step_time,
        busy=busy,
        bubble_fraction=bubble,
        peak_held=peak_held(schedule),
    )
