"""Each measured step of ``xgrad bench pipeline`` run again in the simulator from its own
measured costs, to check the simulator against the runtime.

The runtime records every action of a step (its start, end, and the time it was blocked
on a message). From one step's records this module takes what the simulator is fed:

* each action's own cost: its wall time without the time it was blocked;
* each message's latency: from the end of its send to the wake-up of the receiver that
  blocked on it (``time.perf_counter`` is one clock for the processes of a machine); a
  message whose receiver did not block arrived before it was needed, so it is given none
  (the simulator then finds whether it is late in its own timeline);
* each rank's mean time between actions (the runtime's own loop, posting receives).

:func:`~xgrad.pipeline.simulate_messages` then finds when every action can start, and so
the idle time, from these alone: the time each rank spent waiting is not fed to it. The
steps of a run are not alike (on a busy machine one step's actions all run slower, and a
message's wake-up is either near zero or milliseconds, as the scheduler finds a core), so
costs pooled over steps and drawn independently lose what makes a step slow; replaying each
step with its own costs checks the model itself.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

import xgrad.pipeline as xp
from xgrad.pipeline import Action, Kind, Schedule
from xgrad.pipeline.simulate import dependencies

__all__ = [
    "Replayed",
    "action_span",
    "message_latencies",
    "replay_step",
    "replay_steps",
    "step_costs",
]

#: one rank's records of one step: ``(action text, start, end, seconds blocked)``.
Records = Sequence[tuple[str, float, float, float]]

#: a pass blocked at most this long counts as not blocked (the wait's own bookkeeping).
_BLOCKED = 20e-6


def step_costs(records: Sequence[Records]) -> dict[Action, float]:
    """Every action's own seconds in one step (wall time without the time blocked)."""
    return {
        Action.parse(text): end - start - waited
        for recs in records
        for text, start, end, waited in recs
    }


def message_latencies(schedule: Schedule, records: Sequence[Records]) -> dict[Action, float]:
    """Per send action of one step, the seconds from its end to the wake-up of the pass
    that blocked on it (the last of the pass's remote inputs to be sent). Passes that did
    not block, or whose sends were not recorded, give none. May be negative: a waking
    receiver can preempt its sender before the send action ends."""
    placement = schedule.placement
    ends = {text: end for recs in records for text, _, end, _ in recs}
    out: dict[Action, float] = {}
    for recs in records:
        for text, start, _, waited in recs:
            action = Action.parse(text)
            if not action.kind.is_compute or waited < _BLOCKED:
                continue
            sends: list[tuple[float, Action]] = []
            known = True
            for d in dependencies(schedule, action):
                if placement[d.stage] != placement[action.stage]:
                    kind = Kind.SEND_F if d.kind is Kind.FORWARD else Kind.SEND_B
                    send = Action(d.stage, kind, d.microbatch)
                    end = ends.get(str(send))
                    known = known and end is not None
                    if end is not None:
                        sends.append((end, send))
            if sends and known:
                end, send = max(sends, key=lambda x: x[0])
                out[send] = start + waited - end
    return out


def _dispatch(records: Sequence[Records]) -> list[float]:
    """Per rank, its mean seconds between the end of an action and the start of the next."""
    return [
        sum(b[1] - a[2] for a, b in itertools.pairwise(recs)) / max(1, len(recs) - 1)
        for recs in records
    ]


def replay_step(schedule: Schedule, records: Sequence[Records]) -> tuple[float, float]:
    """``(seconds, busy seconds)`` of one measured step simulated from its own costs:
    from the first action's start on any rank to the last one's end, and the summed
    compute of all ranks. Latencies below zero count as zero (the data was there when the
    send ended)."""
    sched = schedule if schedule.has_comms else xp.insert_comms(schedule)
    costs = step_costs(records)
    lags = {a: max(0.0, t) for a, t in message_latencies(sched, records).items()}
    dispatch = _dispatch(records)
    sim = xp.simulate_messages(
        sched,
        lambda a: costs.get(a, 0.0),
        latency=lambda send: lags.get(send, 0.0),
        dispatch=dispatch.__getitem__,
    )
    return sim.makespan, sum(sim.busy)


def action_span(records: Sequence[Records]) -> float:
    """Seconds from the first action's start on any rank to the last one's end."""
    starts = [start for recs in records for _, start, _, _ in recs]
    ends = [end for recs in records for _, _, end, _ in recs]
    return max(ends) - min(starts)


class Replayed:
    """The measured and the simulated figures of a run's steps (medians over steps).

    Attributes:
        measured: the median step (a step's time is its slowest rank's).
        simulated: the median of the steps simulated from their own costs, plus each
            step's fixed part.
        fixed: the median fixed part (the step outside its actions).
        bubble_measured / bubble_simulated: the median over steps of the step's bubble,
            ``1 - compute / (p * step)``, with the same compute on both sides.
    """

    def __init__(
        self,
        measured: list[float],
        simulated: list[float],
        busy: list[float],
        p: int,
        fixed: list[float],
    ):
        self.measured = statistics.median(measured)
        self.simulated = statistics.median(simulated)
        self.fixed = statistics.median(fixed)
        self.bubble_measured = statistics.median(
            1 - b / (p * t) for b, t in zip(busy, measured, strict=True)
        )
        self.bubble_simulated = statistics.median(
            1 - b / (p * t) for b, t in zip(busy, simulated, strict=True)
        )


def replay_steps(
    schedule: Schedule,
    steps: Sequence[Sequence[Records]],
    times: Sequence[float],
    fixed: float | None = None,
) -> Replayed:
    """Replay every step (``steps[k]`` its records per rank, ``times[k]`` its measured
    time) and add the step's fixed part, its setup and teardown outside the actions, to
    each: ``fixed`` when given, else each step's own, its measured time less its
    :func:`action_span` (what the slowest rank spent before the first action anywhere and
    after the last: the simulator models the actions and messages, not that).
    """
    if not steps or len(steps) != len(times):
        raise ValueError(f"steps ({len(steps)}) and times ({len(times)}) must match, not empty")
    simulated, busy, parts = [], [], []
    for records, measured in zip(steps, times, strict=True):
        seconds, compute = replay_step(schedule, records)
        part = measured - action_span(records) if fixed is None else fixed
        simulated.append(seconds + part)
        busy.append(compute)
        parts.append(part)
    p = schedule.num_ranks
    return Replayed(list(times), simulated, busy, p, parts)
