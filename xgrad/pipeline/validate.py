"""Schedule validation; an error draws the rank × step grid and points at the failing step."""

from __future__ import annotations

from xgrad.pipeline.actions import Action, Kind, expand
from xgrad.pipeline.edge_order import first_misordered
from xgrad.pipeline.schedule import Schedule

__all__ = ["ScheduleError", "check_placement", "check_ranks", "validate"]

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741


class ScheduleError(ValueError):
    """A schedule that cannot run; the message ends with the grid, the failing step marked.

    Attributes:
        rank: the rank at fault (the first stuck one for a deadlock).
        step: the index of the failing action in that rank's list.
    """

    def __init__(self, schedule: Schedule, rank: int, step: int, reason: str) -> None:
        self.rank = rank
        self.step = step
        self.reason = reason
        grid = schedule.grid(mark=step, note=f"rank {rank}: {reason}")
        super().__init__(
            f"schedule {schedule.name!r} is invalid at rank {rank}, step {step}: {reason}\n{grid}"
        )


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


def _check_comm_ends(schedule: Schedule, r: int, i: int, a: Action) -> None:
    k = a.kind
    forward_end = k in (Kind.SEND_F, Kind.RECV_B)
    neighbours = schedule.consumers(a.stage) if forward_end else schedule.sources(a.stage)
    if not neighbours:
        if k in (Kind.SEND_F, Kind.SEND_B):
            raise ScheduleError(schedule, r, i, f"{a} sends past the end of the pipeline")
        raise ScheduleError(schedule, r, i, f"{a} receives from beyond the end of the pipeline")
    if not comm_partners(schedule, a):
        raise ScheduleError(schedule, r, i, f"{a} talks to its own rank {r}")


def _flat(schedule: Schedule) -> list[list[Action]]:
    """Each rank's actions with overlapped pairs expanded (one thread runs them in turn)."""
    return [list(expand(acts)) for acts in schedule.actions]


_SHARD_OPS = (Kind.UNSHARD, Kind.RESHARD)


def _check_shards(schedule: Schedule, r: int, acts: list[Action]) -> None:
    """UNSHARD and RESHARD of a stage alternate, from UNSHARD, and a stage that has them
    computes only while unsharded. A stage may be resharded and unsharded again between
    its passes (torch's lowering keeps 3 stages unsharded at once)."""
    stages = {a.stage for a in acts if a.kind in _SHARD_OPS}
    active: set[int] = set()
    for i, a in enumerate(acts):
        if a.kind is Kind.UNSHARD:
            if a.stage in active:
                raise ScheduleError(schedule, r, i, f"{a}: stage {a.stage} is unsharded already")
            active.add(a.stage)
        elif a.kind is Kind.RESHARD:
            if a.stage not in active:
                raise ScheduleError(schedule, r, i, f"{a}: stage {a.stage} is not unsharded")
            active.remove(a.stage)
        elif a.kind.is_compute and a.stage in stages and a.stage not in active:
            raise ScheduleError(
                schedule, r, i, f"{a} runs while stage {a.stage} is resharded (no UNSHARD)"
            )


def _check_reduced_after_backward(
    schedule: Schedule, r: int, i: int, a: Action, seen: dict[Action, tuple[int, int]]
) -> None:
    """A stage's REDUCE_GRAD comes after every pass that adds to its weights' gradients
    (B, or W where the backward is split), as torch's lowering places it: one before
    would reduce gradients still to come, and leave the replicas apart."""
    s = a.stage
    for mb in range(schedule.num_microbatches):
        kind = schedule.backward_kind(s, mb)
        last = Action(s, W if kind is I else kind, mb)
        if last not in seen:
            raise ScheduleError(
                schedule, r, i, f"{a} runs before {last}: it must follow every backward of "
                f"stage {s}"
            )  # fmt: skip


def check_placement(schedule: Schedule) -> None:
    """Every action is listed on the rank its stage is placed on.

    Checked first (by :func:`~xgrad.pipeline.insert_comms` too): a row that contradicts
    ``placement`` otherwise shows up later as inputs that never come, a deadlock.
    """
    for r, acts in enumerate(_flat(schedule)):
        for i, a in enumerate(acts):
            q = schedule.placement[a.stage]
            if q != r:
                raise ScheduleError(
                    schedule, r, i, f"{a}: stage {a.stage} is listed on rank {r}, but "
                    f"placement puts it on rank {q} (placement {list(schedule.placement)})"
                )  # fmt: skip


def check_ranks(schedule: Schedule) -> None:
    """Every rank holds a stage.

    torch's schedules build a ``PipelineStage`` on every rank of the group, and xgrad's
    torch runtime refuses a rank with none, so no runtime runs a schedule with an idle
    rank; validated, it passed, and :func:`~xgrad.pipeline.simulate` counted the idle rank
    into the bubble. Such a schedule is most often a slip (a blank last row in a CSV, one
    rank too many), refused naming the rank (checked by :func:`validate` and both
    simulators).
    """
    held = set(schedule.placement)
    for r in range(schedule.num_ranks):
        if r not in held:
            raise ScheduleError(
                schedule, r, 0, f"rank {r} holds no stage (placement {list(schedule.placement)}"
                f"); every rank of a schedule runs a stage, as in torch's schedules: drop the "
                "rank, or place a stage on it"
            )  # fmt: skip


def _check_contents(schedule: Schedule) -> None:
    """Duplicates, completeness and the local order of each stage's passes."""
    check_placement(schedule)
    seen: dict[Action, tuple[int, int]] = {}
    for r, acts in enumerate(_flat(schedule)):
        _check_shards(schedule, r, acts)
        for i, a in enumerate(acts):
            if a.kind in _SHARD_OPS:
                continue  # they may repeat (_check_shards)
            if a in seen:
                raise ScheduleError(
                    schedule, r, i, f"{a} appears twice (first at step {seen[a][1]})"
                )
            seen[a] = (r, i)
            if a.kind is Kind.REDUCE_GRAD:
                _check_reduced_after_backward(schedule, r, i, a, seen)
            if a.kind.is_stage_op:
                continue
            if a.kind.is_comm:
                _check_comm_ends(schedule, r, i, a)
                continue
            split = schedule.backward_kind(a.stage, a.microbatch) is I
            if (split and a.kind is B) or (not split and a.kind is W):
                full = Action(a.stage, B, a.microbatch)
                mixed = split or any(full in schedule.compute(q) for q in range(schedule.num_ranks))
                raise ScheduleError(
                    schedule,
                    r,
                    i,
                    f"{a} mixes full backward (B) with split backward (I, W) for one microbatch"
                    if mixed
                    else f"{a} has no I: a split backward's W follows the I of its microbatch",
                )
            need = {
                F: None,
                B: Action(a.stage, F, a.microbatch),
                I: Action(a.stage, F, a.microbatch),
                W: Action(a.stage, I, a.microbatch),
            }[a.kind]
            if need is not None and need not in seen:
                raise ScheduleError(schedule, r, i, f"{a} runs before {need}")
    for s in range(schedule.num_stages):
        for mb in range(schedule.num_microbatches):
            backward = schedule.backward_kind(s, mb)
            for k in (F, backward, W) if backward is I else (F, backward):
                a = Action(s, k, mb)
                if a not in seen:
                    r = schedule.placement[s]
                    raise ScheduleError(
                        schedule, r, len(schedule.actions[r]), f"{a} is missing from rank {r}"
                    )


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


def _check_pairs(schedule: Schedule) -> None:
    """Every send has its receive on the peer and vice versa; cross-rank inputs are received."""
    where = {a: (r, i) for r, acts in enumerate(_flat(schedule)) for i, a in enumerate(acts)}
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


def _run(schedule: Schedule, rendezvous: bool) -> None:
    """Execute in lock step; a step where no rank can move is a deadlock."""
    p = schedule.num_ranks
    heads = [0] * p
    done: set[Action] = set()
    acts = _flat(schedule)
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


def validate(schedule: Schedule, *, rendezvous: bool = True) -> Schedule:
    """Check that ``schedule`` can run, and return it.

    Checks: every rank holds a stage; each action on the rank of its stage, once; every
    (stage, microbatch) has its forward and its backward (B, or I and W); a forward before
    its backward and I before W; every send matched by a receive on the peer and every cross-rank input received; each
    edge's messages taken in the order they are sent (a runtime matches them first in, first
    out, see :mod:`~xgrad.pipeline.edge_order`); and that executing it cannot deadlock.
    Point-to-point is taken as blocking: with ``rendezvous`` a send and its receive complete
    together (the strictest model; a schedule valid under it is valid with buffered sends
    too), otherwise a send never blocks and a receive waits for its send. A compute-only
    schedule waits on the other ranks' passes.

    Raises:
        ScheduleError: naming the rank and step, with the rank × step grid marked there.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    check_ranks(schedule)
    _check_contents(schedule)
    if schedule.has_comms:
        _check_pairs(schedule)
    misordered = first_misordered(schedule)
    if misordered is not None:
        raise ScheduleError(schedule, misordered.rank, misordered.step, misordered.reason)
    _run(schedule, rendezvous)
    return schedule
