"""Passes from schedule to schedule: add the sends and receives, or take them out."""

from __future__ import annotations

from dataclasses import replace

from xgrad.pipeline.actions import Action, Kind
from xgrad.pipeline.schedule import Schedule
from xgrad.pipeline.validate import ScheduleError, check_placement

__all__ = ["add_stage_ops", "insert_comms", "strip_comms"]


def strip_comms(schedule: Schedule) -> Schedule:
    """The compute-only schedule (what the generators make and CSV ``compute_only`` holds)."""
    actions = tuple(tuple(a for a in acts if a.kind.is_compute) for acts in schedule.actions)
    # (UNSHARD, RESHARD and REDUCE_GRAD go too: torch's compute-only form has none.)
    return replace(schedule, actions=actions)


#: stages a rank keeps unsharded at once when :func:`add_stage_ops` places UNSHARD and
#: RESHARD: torch's lowering (``_add_unshard_reshard``) prefetches this many.
MAX_ACTIVE_STAGES = 3


def add_stage_ops(schedule: Schedule, max_active_stages: int = MAX_ACTIVE_STAGES) -> Schedule:
    """Add torch's stage-level actions where torch's lowering places them: REDUCE_GRAD
    after a stage's last backward (B, or W when split); UNSHARD and RESHARD from a window
    over the rank's next ``max_active_stages`` distinct stages.

    Before each compute action, the stages that leave the window are resharded (in the
    order of torch's set of active stages) and those that enter it are unsharded (in the
    order they come up); what is still unsharded at the end is resharded there. With at
    most ``max_active_stages`` stages on a rank, each is unsharded once at the start and
    resharded once, right after its last backward; with more (interleaved schedules of
    many chunks), a stage may be resharded and unsharded again between its passes.

    A runtime reduces a stage's gradients across data-parallel replicas at REDUCE_GRAD (so
    split backward works with data parallelism too) and gathers/frees sharded weights at
    UNSHARD/RESHARD.
    """
    if any(a.kind.is_stage_op for acts in schedule.actions for a in acts):
        raise ValueError(f"schedule {schedule.name!r} already has stage-level actions")
    if not isinstance(max_active_stages, int) or max_active_stages < 1:
        raise ValueError(f"max_active_stages must be an int >= 1, got {max_active_stages!r}")
    out = []
    for acts in schedule.actions:
        flat = list(acts)
        last: dict[int, int] = {}
        for i, a in enumerate(flat):
            for sub in a.sub or (a,):
                if sub.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
                    last[sub.stage] = i
        body = _unshard_reshard(flat, max_active_stages)
        with_reduce: list[Action] = []
        index = 0  # position in flat of the next compute action of body
        for a in body:
            with_reduce.append(a)
            if a.kind.is_stage_op:
                continue
            with_reduce += [Action.stage_op(s, Kind.REDUCE_GRAD) for s in _finished(a, index, last)]
            index += 1
        out.append(tuple(with_reduce))
    return replace(schedule, actions=tuple(out))


def _stages(a: Action) -> list[int]:
    return [sub.stage for sub in a.sub or (a,)]


def _finished(a: Action, index: int, last: dict[int, int]) -> list[int]:
    """The stages whose last backward is ``a`` (at ``index``), in ``a``'s order."""
    return [s for s in dict.fromkeys(_stages(a)) if last.get(s) == index]


def _unshard_reshard(flat: list[Action], window: int) -> list[Action]:
    """``flat`` with UNSHARD/RESHARD around it, as torch's lowering places them."""
    # A set, as torch's: the order RESHARDs come out in is its iteration order, which
    # follows from the same additions and removals.
    active: set[int] = set()
    out: list[Action] = []
    for i, a in enumerate(flat):
        upcoming: list[int] = []
        for b in flat[i:]:
            upcoming += [s for s in dict.fromkeys(_stages(b)) if s not in upcoming]
            if len(upcoming) >= window:
                break
        for s in [s for s in active if s not in upcoming]:
            active.remove(s)
            out.append(Action.stage_op(s, Kind.RESHARD))
        for s in upcoming:
            if s not in active:
                active.add(s)
                out.append(Action.stage_op(s, Kind.UNSHARD))
        out.append(a)
    for s in list(active):
        active.remove(s)
        out.append(Action.stage_op(s, Kind.RESHARD))
    return out


def insert_comms(schedule: Schedule) -> Schedule:
    """Add a send after each pass whose result another rank needs, and the matching receive.

    The ranks are walked in lock step; a rank places its next compute action once its inputs
    are available locally (made on the rank, or already received), and a send is placed on
    the sender and its receive on the receiver at the same moment. Every rank's list is then
    a subsequence of one global order in which each send sits next to its receive, so a
    chain's result cannot deadlock even when a send blocks until its receive is posted.
    A DAG stage fed by several stages of another rank takes one receive for all their
    sends, placed with the last: the earlier sends must not block (torch's and xgrad's
    runtimes post them and go on; ``validate(..., rendezvous=False)`` checks that model).

    Raises:
        ValueError: the schedule already has comms.
        ScheduleError: an action listed on a rank its stage is not placed on, or no order
            exists (a compute schedule that cannot run).
    """
    if schedule.has_comms:
        raise ValueError(f"schedule {schedule.name!r} already has sends and receives")
    check_placement(schedule)
    place = schedule.placement
    p = schedule.num_ranks
    out: list[list[Action]] = [[] for _ in range(p)]
    have: list[set[Action]] = [set() for _ in range(p)]
    heads = [0] * p
    # Per receive not yet placed (a DAG stage may take from several ranks): the sends still
    # to come. A receive is placed when its last send is, so it never waits for a later one.
    waiting: dict[Action, set[Action]] = {}

    def ready(a: Action, r: int) -> bool:
        if a.kind is Kind.OVERLAP_F_B:
            return all(ready(sub, r) for sub in a.sub)
        s, mb = a.stage, a.microbatch
        if a.kind is Kind.FORWARD:
            return all(
                Action(t, Kind.FORWARD, mb) in have[r] or Action(s, Kind.RECV_F, mb) in have[r]
                for t in schedule.sources(s)
            )
        if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
            return all(
                Action(t, schedule.backward_kind(t, mb), mb) in have[r]
                or Action(s, Kind.RECV_B, mb) in have[r]
                for t in schedule.consumers(s)
            )
        return True

    def place_action(a: Action, r: int) -> None:
        out[r].append(a)
        have[r].add(a)

    def send(sub: Action, r: int, neighbours: tuple[int, ...], kinds: tuple[Kind, Kind]) -> None:
        remote = [t for t in neighbours if place[t] != r]
        if not remote:
            return
        sent = Action(sub.stage, kinds[0], sub.microbatch)
        place_action(sent, r)
        for t in remote:
            recv = Action(t, kinds[1], sub.microbatch)
            # The receiver's other remote neighbours (sources of a forward, consumers of a
            # backward) must all have sent first.
            others = schedule.sources(t) if kinds[1] is Kind.RECV_F else schedule.consumers(t)
            pending = waiting.setdefault(
                recv,
                {Action(o, kinds[0], sub.microbatch) for o in others if place[o] != place[t]},
            )
            pending.discard(sent)
            if not pending:
                place_action(recv, place[t])

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
                if sub.kind is Kind.FORWARD:
                    send(sub, r, schedule.consumers(sub.stage), (Kind.SEND_F, Kind.RECV_F))
                elif sub.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
                    send(sub, r, schedule.sources(sub.stage), (Kind.SEND_B, Kind.RECV_B))
            heads[r] += 1
            moved = True
        if not moved:
            stuck = [r for r in range(p) if heads[r] < len(schedule.actions[r])]
            r0 = stuck[0]
            waits = "; ".join(f"rank {r} waits at {schedule.actions[r][heads[r]]}" for r in stuck)
            raise ScheduleError(schedule, r0, heads[r0], f"cannot place comms, deadlock: {waits}")
    return replace(schedule, actions=tuple(tuple(acts) for acts in out))
