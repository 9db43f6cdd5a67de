"""Edge order: ranks that order one edge's messages differently are refused up front.

xgrad's torch runtime takes each edge's messages first in, first out (one tag per edge and
direction); such a schedule used to validate and then fail mid-step with "rank 1 sent
microbatch 0 where 1 was expected".
"""

from __future__ import annotations

import itertools

import pytest

import xgrad.pipeline as xp
from xgrad.pipeline import Action, Schedule, ScheduleError
from xgrad.pipeline.edge_order import first_misordered


def sched(rows: list[str], placement: tuple[int, ...], m: int) -> Schedule:
    return Schedule(
        tuple(tuple(Action.parse(t) for t in row.split()) for row in rows), placement, m
    )


SWAP_B = ["0F0 0F1 0B1 0B0", "1F0 1B0 1F1 1B1"]  # rank 1 returns mb 0 first, rank 0 wants 1
LAST_REVERSED = ["0F0 0F1 0F2 0B2 0B1 0B0", "1F2 1F1 1F0 1B2 1B1 1B0"]


@pytest.mark.parametrize("comms", [False, True])
@pytest.mark.parametrize("rendezvous", [True, False])
def test_gradients_taken_in_another_order_than_sent(comms: bool, rendezvous: bool) -> None:
    s = sched(SWAP_B, (0, 1), 2)
    s = xp.insert_comms(s) if comms else s
    with pytest.raises(ScheduleError) as info:
        xp.validate(s, rendezvous=rendezvous)
    err = info.value
    assert (
        "gradients from stage 1 (rank 1) to stage 0 (rank 0) are out of order: rank 1 sends "
        "microbatches 0, 1; rank 0 expects, at its backward passes, 1, 0"
    ) in str(err)
    # Marked at the pass that would take the wrong message: 0B1.
    assert err.rank == 0
    assert list(xp.expand(s.actions[0]))[err.step] == Action.parse("0B1")


def test_forwards_of_the_last_stage_in_reverse() -> None:
    s = sched(LAST_REVERSED, (0, 1), 3)
    want = (
        r"activations from stage 0 \(rank 0\) to stage 1 \(rank 1\) are out of order: rank 0 "
        "sends microbatches 0, 1, 2; rank 1 expects, at its forward passes, 2, 1, 0"
    )
    for x in (s, xp.insert_comms(s)):
        with pytest.raises(ScheduleError, match=want):
            xp.validate(x, rendezvous=False)


def test_receives_posted_in_another_order_than_sent() -> None:
    """The passes agree with the sends, the receive actions do not: the runtime posts
    receives in their order, and gloo pairs the n-th send with the n-th receive."""
    rows = [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F1 1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
    ]
    with pytest.raises(ScheduleError, match=r"rank 1 posts its receives \(RECV_F\) for 1, 0"):
        xp.validate(sched(rows, (0, 1), 2), rendezvous=False)


def test_only_each_edge_and_direction_is_ordered() -> None:
    """Interleaved stages on the same two ranks (edges 0->1, 1->2, 2->3) may interleave
    their messages freely; each edge's own sequence agrees."""
    s = xp.interleaved_1f1b(2, 4, chunks=2)
    assert first_misordered(s) is None
    assert first_misordered(xp.insert_comms(s)) is None
    # A DAG: stage 2 takes stages 0 and 1, all three on different ranks.
    inv = xp.dag([(0, 0), (1, 0), (2, 0)], [(), (0,), (0, 1)])
    assert first_misordered(xp.insert_comms(xp.from_invocations(inv, 3, "1f1b"))) is None


def test_long_orders_are_shown_around_the_first_difference() -> None:
    m = 12
    fwd = " ".join(f"0F{i}" for i in range(m))
    bwd = " ".join(f"0B{i}" for i in range(m))
    order = [*range(6), 7, 6, *range(8, m)]
    last = " ".join(f"1F{i} 1B{i}" for i in order)
    want = (
        r"sends microbatches \.\.\., 3, 4, 5, 6, 7, 8, 9, \.\.\.; rank 1 expects, at its "
        r"forward passes, \.\.\., 3, 4, 5, 7, 6, 8, 9, \.\.\."
    )
    with pytest.raises(ScheduleError, match=want):
        xp.validate(sched([f"{fwd} {bwd}", last], (0, 1), m), rendezvous=False)


@pytest.mark.parametrize("name", sorted(xp.SCHEDULES))
def test_every_generated_schedule_orders_its_edges_alike(name: str) -> None:
    for p, m, v in itertools.product((1, 2, 3, 4), (1, 2, 3, 5, 8), (1, 2, 3)):
        try:
            s = xp.make(name, p, m, chunks=v)
        except ValueError:
            continue  # a size this schedule does not come in
        for x in (s, xp.insert_comms(s), xp.insert_comms(xp.add_stage_ops(s))):
            assert first_misordered(x) is None, (name, p, m, v, x.has_comms)
