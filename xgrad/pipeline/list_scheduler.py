"""The list scheduler: a rank's order of passes from a unit clock, for any placement.

A free rank picks, among its stages' ready actions, the oldest microbatch's backward
first (deepest stage first), else a forward while it holds fewer activation sets than
its limit, else the oldest pending W; :func:`list_schedule` runs that on a unit clock
(F = I = W = 1, B = 2), driven by events. It orders ZB-H2
(:func:`~xgrad.pipeline.generators.zb_h2`) and every placement of invocations
(:func:`from_invocations`: a rank visited twice, a reused module, a DAG). Kept apart from
:mod:`xgrad.pipeline.generators` (the closed-form schedules, drawn next to their code,
which re-exports :func:`from_invocations`) because it is one algorithm of its own, and
the longest.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from xgrad.pipeline.actions import Action, Kind
from xgrad.pipeline.invocation import Invocation, placement_of, sources_of
from xgrad.pipeline.multistage import check_count
from xgrad.pipeline.schedule import Schedule

__all__ = ["from_invocations", "list_schedule"]

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741


def list_schedule(
    placement: tuple[int, ...],
    m: int,
    limits: list[int],
    *,
    split: bool,
    forward_first: bool = False,
    sources: tuple[tuple[int, ...], ...] | None = None,
) -> list[list[Action]]:
    """List-schedule on a unit clock (F = I = W = 1, B = 2); the order per rank is the schedule.

    A free rank runs, among its stages' ready actions: the backward (B, or I when ``split``)
    of the oldest microbatch, deepest stage first; else a forward while it holds fewer than
    ``limits[rank]`` activation sets; else the oldest pending W. ``forward_first`` swaps the
    first two (GPipe's fill-drain). ``sources`` gives a DAG's inputs per stage (default: the
    chain).
    """
    n = len(placement)
    srcs = sources or tuple((s - 1,) if s else () for s in range(n))
    users: list[list[int]] = [[] for _ in range(n)]
    for t, ins in enumerate(srcs):
        for u in ins:
            users[u].append(t)
    p = max(placement) + 1
    bwd = I if split else B
    done_at: dict[Action, int] = {}
    order: list[list[Action]] = [[] for _ in range(p)]
    next_f, next_b, next_w = [0] * n, [0] * n, [0] * n
    held, free = [0] * p, [0] * p
    stages = [[s for s in range(n) if placement[s] == r] for r in range(p)]
    # Driven by events, not by every tick for every rank (quadratic in p: ZB-H2 took 5.6 s at
    # p = 1000, m = 1): a rank's choice changes only when it is free again or when an action of a
    # stage next to one of its own (its own, a source, a user) ends, so it is looked at
    # then alone. Ranks never see each other's picks of the same tick (an action is done
    # a tick later at the earliest), so their order within a tick does not matter.
    near = [{placement[u] for u in (s, *srcs[s], *users[s])} for s in range(n)]
    wake: dict[int, set[int]] = {0: set(range(p))}
    ticks = [0]
    unfinished = n  # stages with a W (B without ``split``) still to pick
    while unfinished:
        if not ticks:  # before the scheduler ticked on for ever
            raise ValueError(
                f"list scheduling stalls at tick {t}: no rank can run an action, "
                f"{unfinished} of {n} stages unfinished, each rank holding at most "
                f"{max(limits)} activation sets (placement {placement}, m = {m})"
            )
        t = heapq.heappop(ticks)
        for r in wake.pop(t):
            if free[r] > t:
                continue

            def ready(a: Action, _t: int = t) -> bool:
                return done_at.get(a, _t + 1) <= _t

            backward = [
                Action(s, bwd, next_b[s])
                for s in stages[r]
                if next_b[s] < m
                and ready(Action(s, F, next_b[s]))
                and all(ready(Action(t, bwd, next_b[s])) for t in users[s])
            ]
            forward = [
                Action(s, F, next_f[s])
                for s in stages[r]
                if next_f[s] < m
                and held[r] < limits[r]
                and all(ready(Action(u, F, next_f[s])) for u in srcs[s])
            ]
            weight = [Action(s, W, next_w[s]) for s in stages[r] if split and next_w[s] < next_b[s]]
            key = lambda a: (a.microbatch, -a.stage)  # noqa: E731
            groups = [forward, backward] if forward_first else [backward, forward]
            candidates = [sorted(g, key=key) for g in [*groups, weight] if g]
            if not candidates:
                continue
            pick = candidates[0][0]
            s = pick.stage
            if pick.kind is F:
                next_f[s] += 1
                held[r] += 1
            elif pick.kind is W:
                next_w[s] += 1
                held[r] -= 1
                if next_w[s] == m:
                    unfinished -= 1
            else:
                next_b[s] += 1
                held[r] -= 0 if split else 1
                if next_b[s] == m and not split:
                    unfinished -= 1
            order[r].append(pick)
            done = done_at[pick] = free[r] = t + (2 if pick.kind is B else 1)
            if done not in wake:
                wake[done] = set()
                heapq.heappush(ticks, done)
            wake[done] |= near[s]
    return order


def from_invocations(
    invocations: Sequence[Invocation], num_microbatches: int, policy: str = "1f1b"
) -> Schedule:
    """A schedule for any placement of invocations (a rank visited twice, a reused module).

    Policies: ``"gpipe"`` (forwards first, nothing limits the activations held), ``"1f1b"``
    (backward first, each rank holds at most as many activation sets as there are virtual
    stages) and ``"zb"`` (backward split into I and W, I first, W fills the gaps, up to twice
    that many held). Orders come from list scheduling on a unit clock.

    Raises:
        ValueError: an unknown policy, or one that stalls on this placement (every rank at
            its activation limit, waiting on another's: ``"1f1b"`` with rank 1 holding the
            first and the last two of six stages, m = 7; it ticked on for ever before);
            ``"gpipe"`` and ``"zb"`` hold more.

    Example:
        >>> from xgrad.pipeline import chain
        >>> s = from_invocations(chain([(0, 0), (1, 0), (0, 1)]), 2, "gpipe")
        >>> [str(a) for a in s.actions[0]]
        ['0F0', '0F1', '2F0', '2F1', '2B0', '2B1', '0B0', '0B1']
    """
    placement = placement_of(invocations)
    srcs = sources_of(invocations)
    m = check_count("num_microbatches", num_microbatches)
    n, p = len(placement), max(placement) + 1
    if policy == "gpipe":
        order = list_schedule(
            placement, m, [n * m] * p, split=False, forward_first=True, sources=srcs
        )
    elif policy == "1f1b":
        order = list_schedule(placement, m, [n] * p, split=False, sources=srcs)
    elif policy == "zb":
        order = list_schedule(placement, m, [2 * n - 1] * p, split=True, sources=srcs)
    else:
        raise ValueError(f"policy must be 'gpipe', '1f1b' or 'zb', got {policy!r}")
    chain = all(ins == ((t - 1,) if t else ()) for t, ins in enumerate(srcs))
    return Schedule(
        tuple(tuple(a) for a in order),
        placement,
        m,
        f"{policy}(invocations)",
        () if chain else srcs,
    )
