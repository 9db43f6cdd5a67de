"""Passes from schedule to schedule: add the sends and receives, or take them out."""

from __future__ import annotations

from xgrad.pipeline.actions import Action, Kind
from xgrad.pipeline.schedule import Schedule
from xgrad.pipeline.validate import ScheduleError

__all__ = ["insert_comms", "strip_comms"]


def strip_comms(schedule: Schedule) -> Schedule:
    """The compute-only schedule (what the generators make and CSV ``compute_only`` holds)."""
    actions = tuple(tuple(a for a in acts if a.kind.is_compute) for acts in schedule.actions)
    # (UNSHARD, RESHARD and REDUCE_GRAD go too: torch's compute-only form has none.)
    return Schedule(actions, schedule.placement, schedule.num_microbatches, schedule.name)


def insert_comms(schedule: Schedule) -> Schedule:
    """Add a send after each pass whose result another rank needs, and the matching receive.

    The ranks are walked in lock step; a rank places its next compute action once its inputs
    are available locally (made on the rank, or already received), and a send is placed on
    the sender and its receive on the receiver at the same moment. Every rank's list is then
    a subsequence of one global order in which each send sits next to its receive, so the
    result cannot deadlock even when a send blocks until its receive is posted.

    Raises:
        ValueError: the schedule already has comms.
        ScheduleError: no order exists (a compute schedule that cannot run).
    """
    if schedule.has_comms:
        raise ValueError(f"schedule {schedule.name!r} already has sends and receives")
    place = schedule.placement
    last = schedule.num_stages - 1
    p = schedule.num_ranks
    out: list[list[Action]] = [[] for _ in range(p)]
    have: list[set[Action]] = [set() for _ in range(p)]
    heads = [0] * p

    def ready(a: Action, r: int) -> bool:
        if a.kind is Kind.OVERLAP_F_B:
            return all(ready(sub, r) for sub in a.sub)
        s, mb = a.stage, a.microbatch
        if a.kind is Kind.FORWARD and s > 0:
            return bool({Action(s - 1, Kind.FORWARD, mb), Action(s, Kind.RECV_F, mb)} & have[r])
        if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and s < last:
            upstream = Action(s + 1, schedule.backward_kind(s + 1, mb), mb)
            return bool({upstream, Action(s, Kind.RECV_B, mb)} & have[r])
        return True

    def place_action(a: Action, r: int) -> None:
        out[r].append(a)
        have[r].add(a)

    while any(heads[r] < len(schedule.actions[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if heads[r] >= len(schedule.actions[r]):
                continue
            a = schedule.actions[r][heads[r]]
            if not ready(a, r):
                continue
            place_action(a, r)
            for sub in a.sub or (a,):
                have[r].add(sub)
                s, mb = sub.stage, sub.microbatch
                if sub.kind is Kind.FORWARD and s < last and place[s + 1] != r:
                    place_action(Action(s, Kind.SEND_F, mb), r)
                    place_action(Action(s + 1, Kind.RECV_F, mb), place[s + 1])
                elif (
                    sub.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and s > 0 and place[s - 1] != r
                ):
                    place_action(Action(s, Kind.SEND_B, mb), r)
                    place_action(Action(s - 1, Kind.RECV_B, mb), place[s - 1])
            heads[r] += 1
            moved = True
        if not moved:
            stuck = [r for r in range(p) if heads[r] < len(schedule.actions[r])]
            r0 = stuck[0]
            waits = "; ".join(f"rank {r} waits at {schedule.actions[r][heads[r]]}" for r in stuck)
            raise ScheduleError(schedule, r0, heads[r0], f"cannot place comms, deadlock: {waits}")
    return Schedule(
        tuple(tuple(acts) for acts in out), place, schedule.num_microbatches, schedule.name
    )
