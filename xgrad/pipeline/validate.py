"""Schedule validation; an error draws the rank × step grid and points at the failing step.

Here: the checks of what a schedule lists (ranks, placement, shards, duplicates,
completeness, each stage's passes in order) and :func:`validate`, which runs every check.
Pairing sends with receives and the lock-step run that finds a deadlock are
:mod:`xgrad.pipeline.lockstep`; the error is :mod:`xgrad.pipeline.schedule_error`. Both
are re-exported from here.
"""

from __future__ import annotations

from xgrad.pipeline.actions import Action, Kind
from xgrad.pipeline.edge_order import first_misordered
from xgrad.pipeline.lockstep import check_pairs, comm_partners, flat_actions, run_lock_step
from xgrad.pipeline.lockstep import comm_partner as comm_partner
from xgrad.pipeline.schedule import Schedule
from xgrad.pipeline.schedule_error import ScheduleError as ScheduleError

__all__ = ["ScheduleError", "check_placement", "check_ranks", "validate"]

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741


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
    for r, acts in enumerate(flat_actions(schedule)):
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
    for r, acts in enumerate(flat_actions(schedule)):
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


def validate(schedule: Schedule, *, rendezvous: bool = True) -> Schedule:
    """Check that ``schedule`` can run, and return it.

    Checks: every rank holds a stage; each action on the rank of its stage, once; every
    (stage, microbatch) has its forward and its backward (B, or I and W); a forward before
    its backward and I before W; every send matched by a receive on the peer and every
    cross-rank input received; each edge's receives listed in the order its messages are
    sent (a runtime pairs them in that order, see :mod:`~xgrad.pipeline.edge_order`; the
    passes may use them in another, as in torch's runtime); and that executing it cannot
    deadlock.
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
        check_pairs(schedule)
    misordered = first_misordered(schedule)
    if misordered is not None:
        raise ScheduleError(schedule, misordered.rank, misordered.step, misordered.reason)
    run_lock_step(schedule, rendezvous)
    return schedule
