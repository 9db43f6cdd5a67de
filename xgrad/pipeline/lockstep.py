"""A schedule run in lock step: who each send and receive talks to, and a deadlock found.

Each rank's actions (overlapped pairs expanded) run in turn; an action runs once what it
needs has run (:func:`_needs`: the passes before it on its rank, or the receive that brings
a peer's output), a send and its receive complete together (``rendezvous``) or a send never
blocks, and a step where no rank can move is a deadlock, raised naming every waiting rank.
:func:`check_pairs` first checks that each send has its receive on the peer. Kept apart from
:mod:`xgrad.pipeline.validate` (the checks of what a schedule lists, which calls these and
re-exports :func:`comm_partners` and :func:`comm_partner`) because executing a schedule is
a job of its own.
"""

from __future__ import annotations

from xgrad.pipeline.actions import Action, Kind, expand
from xgrad.pipeline.schedule import Schedule
from xgrad.pipeline.schedule_error import ScheduleError

__all__ = ["check_pairs", "comm_partner", "comm_partners", "flat_actions", "run_lock_step"]

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741


def comm_partners(schedule: Schedule, action: Action) -> list[tuple[int, Action]]:
    """For a send or receive, each peer rank and the matching action it must run (one for
    a chain; a DAG stage may send to several consumers and receive from several sources)."""
    s, mb = action.stage, action.microbatch
    k = action.kind
    place = schedule.placement
    if k in (Kind.SEND_F, Kind.RECV_B):
        stages, partner = schedule.consumers(s), (Kind.RECV_F if k is Kind.SEND_F else Kind.SEND_B)
    elif k in (Kind.RECV_F, Kind.SEND_B):
        stages, partner = schedule.sources(s), (Kind.SEND_F if k is Kind.RECV_F else Kind.RECV_B)
    else:
        raise ValueError(f"{action} is not a send or receive")
    return [(place[t], Action(t, partner, mb)) for t in stages if place[t] != place[s]]


def comm_partner(schedule: Schedule, action: Action) -> tuple[int, Action]:
    """For a send or receive of a chain, the peer rank and the matching action it must run."""
    partners = comm_partners(schedule, action)
    if len(partners) != 1:
        raise ValueError(f"{action} has {len(partners)} partners, not one")
    return partners[0]


def flat_actions(schedule: Schedule) -> list[list[Action]]:
    """Each rank's actions with overlapped pairs expanded (one thread runs them in turn)."""
    return [list(expand(acts)) for acts in schedule.actions]


def _needs(schedule: Schedule, a: Action, r: int) -> list[Action]:
    """What rank r must have run before compute ``a`` (with explicit comms: local actions)."""
    s, mb = a.stage, a.microbatch
    place = schedule.placement
    comms = schedule.has_comms
    if a.kind.is_stage_op:
        return []
    if a.kind is F:
        need = [Action(t, F, mb) for t in schedule.sources(s) if place[t] == r or not comms]
        if len(need) < len(schedule.sources(s)):
            need.append(Action(s, Kind.RECV_F, mb))
        return need
    if a.kind in (B, I):
        need = [Action(s, F, mb)]
        users = schedule.consumers(s)
        need += [
            Action(t, schedule.backward_kind(t, mb), mb)
            for t in users
            if place[t] == r or not comms
        ]
        if len(need) - 1 < len(users):
            need.append(Action(s, Kind.RECV_B, mb))
        return need
    if a.kind is W:
        return [Action(s, I, mb)]
    # A send needs the pass that produced what it sends.
    if a.kind is Kind.SEND_F:
        return [Action(s, F, mb)]
    if a.kind is Kind.SEND_B:
        return [Action(s, schedule.backward_kind(s, mb), mb)]
    return []


def check_pairs(schedule: Schedule) -> None:
    """Every send has its receive on the peer and vice versa; cross-rank inputs are received."""
    where = {a: (r, i) for r, acts in enumerate(flat_actions(schedule)) for i, a in enumerate(acts)}
    for a, (r, i) in where.items():
        if a.kind.is_comm:
            for peer, partner in comm_partners(schedule, a):
                if partner not in where:
                    raise ScheduleError(
                        schedule, r, i, f"{a} has no matching {partner} on rank {peer}"
                    )
        else:
            for need in _needs(schedule, a, r):
                if need.kind.is_comm and need not in where:
                    raise ScheduleError(schedule, r, i, f"{a} needs {need} on rank {r}, never run")


def run_lock_step(schedule: Schedule, rendezvous: bool) -> None:
    """Execute in lock step; a step where no rank can move is a deadlock."""
    p = schedule.num_ranks
    heads = [0] * p
    done: set[Action] = set()
    acts = flat_actions(schedule)
    while any(heads[r] < len(acts[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if heads[r] >= len(acts[r]):
                continue
            a = acts[r][heads[r]]
            if a.kind.is_comm:
                partners = comm_partners(schedule, a)
                if any(n not in done for n in _needs(schedule, a, r)):
                    continue
                is_send = a.kind in (Kind.SEND_F, Kind.SEND_B)
                if rendezvous and len(partners) == 1:
                    peer, partner = partners[0]
                    if heads[peer] < len(acts[peer]) and acts[peer][heads[peer]] == partner:
                        done.update((a, partner))
                        heads[r] += 1
                        heads[peer] += 1
                        moved = True
                # Buffered, and a DAG's send to (receive from) several ranks: a send never
                # blocks, a receive waits for every send it takes.
                elif is_send or all(q in done for _, q in partners):
                    done.add(a)
                    heads[r] += 1
                    moved = True
            elif all(n in done for n in _needs(schedule, a, r)):
                done.add(a)
                heads[r] += 1
                moved = True
        if not moved:
            stuck = [r for r in range(p) if heads[r] < len(acts[r])]
            waits = "; ".join(f"rank {r} waits at {acts[r][heads[r]]}" for r in stuck)
            r0 = min(stuck, key=lambda r: (heads[r], r))
            raise ScheduleError(schedule, r0, heads[r0], f"deadlock: {waits}")
