"""A schedule run on a virtual clock the way a runtime runs it: every action of each rank
in order, sends and receives included, with the CPU time they cost and message latency.

:func:`~xgrad.pipeline.simulate` takes sends and receives as free and a message as
arriving ``comm_cost`` after the pass that made it. A real runtime also spends its own
time on each message (posting a send or a receive, packing, a wake-up) and on each action
(its event loop), on the same core as its compute; on a busy machine that is part of the
step. :func:`simulate_messages` charges each of those, as measured, where the runtime
spends it: a send's cost on its rank between the pass and the next action, a receive's
posting on its rank, ``dispatch`` before every action, and a message arriving ``latency``
after its send ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xgrad.pipeline.actions import Action, Kind, expand
from xgrad.pipeline.passes import insert_comms
from xgrad.pipeline.schedule import Schedule
from xgrad.pipeline.simulate import Simulation, Span, checked_cost, dependencies, summarize
from xgrad.pipeline.validate import check_ranks

__all__ = ["simulate_messages"]


def simulate_messages(
    schedule: Schedule,
    cost: Callable[[Action], float],
    *,
    latency: float | Callable[[Action], float] = 0.0,
    dispatch: float | Callable[[int], float] = 0.0,
    cores: int | None = None,
) -> Simulation:
    """Run every action of every rank (comms inserted if the schedule has none) in order.

    A compute action starts once its rank is free (plus ``dispatch``) and its inputs are
    there: a local one when its pass ended, a remote one ``latency`` after the end of the
    send that carries it. Sends, receives and stage operations take ``cost(action)`` on
    their rank and wait for nothing (receives are posted ahead; the wait is the compute's).

    Args:
        schedule: any valid schedule.
        cost: seconds of every action, compute and comms (a receive's: posting it).
        latency: seconds from the end of a send to its data being usable on the receiver,
            one figure or a function of the send.
        dispatch: seconds each action costs its rank before it starts (the event loop's
            own work), one figure or one per rank.
        cores: the ranks share this many cores (None: one each). Costs are then CPU
            seconds, and while k ranks have work each advances at ``min(1, cores / k)``
            (processor sharing, as the operating system time-slices them).

    Returns:
        A :class:`Simulation` whose spans, ``busy`` and ``bubble_fraction`` count the
        compute actions only (time in sends, receives and dispatch is not compute), and
        whose ``makespan`` is one step alone from the first action to the last.

    Raises:
        ValueError: the schedule cannot finish, or a cost, latency or dispatch is negative,
            NaN or infinite (the error names which, and the action or rank).
        ScheduleError: a rank holds no stage (as :func:`~xgrad.pipeline.simulate`).
    """
    check_ranks(schedule)
    sched = schedule if schedule.has_comms else insert_comms(schedule)
    p = sched.num_ranks
    queues = [list(expand(sched.actions[r])) for r in range(p)]
    where = {a: r for r, q in enumerate(queues) for a in q if a.kind.is_compute}
    # Every figure checked once here (the simulations ask for them again and again).
    costs = {a: checked_cost(cost(a), f"cost({a})") for q in queues for a in q}
    sends = [a for q in queues for a in q if a.kind in (Kind.SEND_F, Kind.SEND_B)]
    if callable(latency):
        lags = {a: checked_cost(latency(a), f"latency({a})") for a in sends}
    else:
        lags = dict.fromkeys(sends, checked_cost(latency, "latency"))
    if callable(dispatch):
        dispatches = [checked_cost(dispatch(r), f"dispatch({r}) (rank {r})") for r in range(p)]
    else:
        dispatches = [checked_cost(dispatch, "dispatch")] * p
    lag = lags.__getitem__
    per_rank = dispatches.__getitem__
    cost = costs.__getitem__
    if cores is None:
        spans, first, free = _dedicated(sched, queues, where, cost, lag, per_rank)
    else:
        if cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores!r}")
        spans, first, free = _shared(sched, queues, where, cost, lag, per_rank, cores)
    starts = [f for f in first if f is not None]
    makespan = max(free) - min(starts) if starts else 0.0
    step_time = max((free[r] - f for r, f in enumerate(first) if f is not None), default=0.0)
    return summarize(sched, spans, makespan, step_time)


def _ready(
    sched: Schedule,
    a: Action,
    rank: int,
    where: dict[Action, int],
    end: dict[Action, float],
    latency: Callable[[Action], float],
) -> float | None:
    """When compute ``a``'s inputs are usable on ``rank`` (None: not simulated yet)."""
    if not a.kind.is_compute:
        return 0.0
    ready = 0.0
    for d in dependencies(sched, a):
        if where.get(d, rank) == rank:
            if d not in end:
                return None
            ready = max(ready, end[d])
            continue
        # Remote: carried by the send that follows the pass on its rank.
        send = Action(d.stage, Kind.SEND_F if d.kind is Kind.FORWARD else Kind.SEND_B, d.microbatch)
        if send not in end:
            return None
        ready = max(ready, end[send] + latency(send))
    return ready


def _dedicated(
    sched: Schedule,
    queues: list[list[Action]],
    where: dict[Action, int],
    cost: Callable[[Action], float],
    latency: Callable[[Action], float],
    per_rank: Callable[[int], float],
) -> tuple[list[list[Span]], list[float | None], list[float]]:
    """Each rank on its own core: an action starts when its rank is free and its inputs are
    there, and takes its cost."""
    p = len(queues)
    end: dict[Action, float] = {}
    spans: list[list[Span]] = [[] for _ in range(p)]
    free = [0.0] * p
    first: list[float | None] = [None] * p
    heads = [0] * p
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for r in range(p):
            while heads[r] < len(queues[r]):
                a = queues[r][heads[r]]
                ready = _ready(sched, a, r, where, end, latency)
                if ready is None:
                    break
                start = max(free[r] + per_rank(r), ready)
                end[a] = free[r] = start + cost(a)
                if first[r] is None:
                    first[r] = start - per_rank(r)
                if a.kind.is_compute:
                    spans[r].append(Span(r, a, start, end[a]))
                heads[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            _stuck(sched, queues, heads)
    return spans, first, free


def _shared(
    sched: Schedule,
    queues: list[list[Action]],
    where: dict[Action, int],
    cost: Callable[[Action], float],
    latency: Callable[[Action], float],
    per_rank: Callable[[int], float],
    cores: int,
) -> tuple[list[list[Span]], list[float | None], list[float]]:
    """The ranks time-slice ``cores`` cores: an event simulation in which each rank's job
    (an action's dispatch, then the action once its inputs are there) advances at
    ``min(1, cores / jobs running)``."""
    p = len(queues)
    end: dict[Action, float] = {}
    spans: list[list[Span]] = [[] for _ in range(p)]
    free = [0.0] * p
    first: list[float | None] = [0.0 if q else None for q in queues]
    heads = [0] * p
    # Per rank: [phase (0 dispatch, 1 action), CPU seconds left, when it may run or None,
    # when the action started]; None once the rank is done.
    jobs: list[list[Any] | None] = [
        [0, per_rank(r), 0.0, 0.0] if queues[r] else None for r in range(p)
    ]
    now = 0.0
    while any(j is not None for j in jobs):
        for r, job in enumerate(jobs):
            if job is not None and job[0] == 1 and job[2] is None:
                job[2] = _ready(sched, queues[r][heads[r]], r, where, end, latency)
        running = [
            r for r, j in enumerate(jobs) if j is not None and j[2] is not None and j[2] <= now
        ]
        rate = min(1.0, cores / len(running)) if running else 0.0
        waits = [j[2] for j in jobs if j is not None and j[2] is not None and j[2] > now]
        steps = [jobs[r][1] / rate for r in running]  # type: ignore[index]
        if not steps and not waits:
            _stuck(sched, queues, heads)
        dt = min(steps + [w - now for w in waits])
        now += dt
        for r in running:
            job = jobs[r]
            assert job is not None
            job[1] -= dt * rate
            if job[1] > 1e-12:
                continue
            if job[0] == 0:  # dispatched: the action waits for its inputs
                a = queues[r][heads[r]]
                job[:] = [1, cost(a), None, 0.0]
                continue
            a = queues[r][heads[r]]
            end[a] = free[r] = now
            if a.kind.is_compute:
                spans[r].append(Span(r, a, job[3], now))
            heads[r] += 1
            jobs[r] = [0, per_rank(r), now, 0.0] if heads[r] < len(queues[r]) else None
        for r, job in enumerate(jobs):
            if job is not None and job[0] == 1 and job[2] is None:
                job[2] = _ready(sched, queues[r][heads[r]], r, where, end, latency)
            if job is not None and job[0] == 1 and job[2] is not None and job[3] == 0.0:
                job[3] = max(now, job[2])
    return spans, first, free


def _stuck(sched: Schedule, queues: list[list[Action]], heads: list[int]) -> None:
    stuck = {r: str(queues[r][heads[r]]) for r in range(len(queues)) if heads[r] < len(queues[r])}
    raise ValueError(f"schedule {sched.name!r} cannot finish; stuck heads per rank: {stuck}")
