"""Edge order: ranks may order one edge's microbatches differently (torch's lowering posts
the receives in the sender's order, and both runtimes take the message a pass needs);
receives listed in another order than the sends, and orders that deadlock, are refused.

Before, validation refused every schedule whose two ranks ordered an edge's microbatches
differently ("out of order ... first in, first out"), in its compute-only form and in
torch's lowered form, though torch's runtime runs it with the right gradients.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import types

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
#: the probe's schedule (3 ranks, split backward): rank 0 sends 1 first, rank 1 takes 0.
PROBE = ["0F1 0F0 0B0 0B1", "1F0 1B0 1F1 1I1 1W1", "2F0 2B0 2F1 2I1 2W1"]
#: two stages a rank, every cross-rank edge taken in another order than sent.
CHUNKS = [
    "0F1 0F0 2F1 2F0 2B1 2B0 0B1 0B0",
    "1F0 1F1 3F0 3I0 3F1 3I1 1B0 1B1 3W0 3W1",
]
REORDERED = [
    (SWAP_B, (0, 1)),
    (LAST_REVERSED, (0, 1)),
    (PROBE, (0, 1, 2)),
    (CHUNKS, (0, 1, 0, 1)),
]


def _m(rows: list[str]) -> int:
    return 1 + max(Action.parse(t).microbatch for row in rows for t in row.split())


@pytest.mark.parametrize(("rows", "placement"), REORDERED)
@pytest.mark.parametrize("rendezvous", [True, False])
def test_passes_may_take_an_edge_in_another_order_than_sent(
    rows: list[str], placement: tuple[int, ...], rendezvous: bool
) -> None:
    """Compute-only, and lowered (receives in the sender's order, by insert_comms)."""
    s = sched(rows, placement, _m(rows))
    assert first_misordered(s) is None
    for x in (s, xp.insert_comms(s), xp.insert_comms(xp.add_stage_ops(s))):
        assert first_misordered(x) is None
        assert xp.validate(x, rendezvous=rendezvous) is x


@pytest.mark.parametrize(("rows", "placement"), REORDERED)
def test_the_lowering_posts_receives_in_the_senders_order_as_torchs(
    rows: list[str], placement: tuple[int, ...]
) -> None:
    """insert_comms(add_stage_ops(...)) is torch's lowering of the CSV, action for action."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    s = sched(rows, placement, _m(rows))
    p, n, m = s.num_ranks, s.num_stages, s.num_microbatches
    stand_in = [
        types.SimpleNamespace(group_size=p, group_rank=0, num_stages=n, stage_index=k, submod=None)
        for k in s.stages_of(0)
    ]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.csv")
        xp.dump_csv(s, path)
        logging.disable(logging.WARNING)
        try:
            runner = schedules.ScheduleLoopedBFS(stand_in, m)
            runner._load_csv(path)
        finally:
            logging.disable(logging.NOTSET)
    theirs = [[str(a) for a in runner.pipeline_order_with_comms[r]] for r in range(p)]
    ours = xp.insert_comms(xp.add_stage_ops(s))
    assert [[str(a) for a in acts] for acts in ours.actions] == theirs
    # Each edge's receives in its sender's order, passes in their own.
    assert first_misordered(ours) is None


@pytest.mark.parametrize(("rows", "placement"), REORDERED)
def test_the_simulators_run_them(rows: list[str], placement: tuple[int, ...]) -> None:
    s = sched(rows, placement, _m(rows))
    sim = xp.simulate(s)
    assert sum(len(spans) for spans in sim.spans) == sum(
        len(s.compute(r)) for r in range(s.num_ranks)
    )
    timed = xp.simulate_messages(s, lambda a: xp.DEFAULT_COSTS.get(a.kind, 0.0))
    assert timed.makespan == sim.makespan


def test_an_order_that_deadlocks_is_refused_naming_rank_action_and_microbatch() -> None:
    """Rank 1 waits for microbatch 1's activations, which rank 0 sends only after
    microbatch 0's gradient, which rank 1 computes after microbatch 1."""
    s = sched(["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], (0, 1), 2)
    for x, rendezvous in ((s, True), (s, False)):
        with pytest.raises(
            ScheduleError, match=r"deadlock: rank 0 waits at 0B0; rank 1 waits at 1F1"
        ):
            xp.validate(x, rendezvous=rendezvous)
    with pytest.raises(
        ScheduleError,
        match=r"cannot place comms, deadlock: rank 0 waits at 0B0; rank 1 waits at 1F1",
    ):
        xp.insert_comms(s)


def test_receives_posted_in_another_order_than_sent() -> None:
    """The receive actions do not follow the sends: the runtime posts receives in their
    order, and gloo pairs the n-th send with the n-th receive (torch's runtime would put
    one microbatch's activations in the other's buffers)."""
    rows = [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F1 1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
    ]
    with pytest.raises(ScheduleError) as info:
        xp.validate(sched(rows, (0, 1), 2), rendezvous=False)
    assert (
        "activations from stage 0 (rank 0) to stage 1 (rank 1) are received out of order: "
        "rank 0 sends microbatches 0, 1; rank 1 posts its receives (RECV_F) for 1, 0"
    ) in str(info.value)
    assert (info.value.rank, info.value.step) == (1, 0)  # at 1RECV_F1
    rows = [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0RECV_B0 0B0 0B1",
        "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
    ]
    with pytest.raises(ScheduleError, match=r"rank 0 posts its receives \(RECV_B\) for 1, 0"):
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
    sender = " ".join(f"0F{i} 0SEND_F{i}" for i in range(m))
    sender += " " + " ".join(f"0RECV_B{i} 0B{i}" for i in range(m))
    order = [*range(6), 7, 6, *range(8, m)]
    receiver = " ".join(f"1RECV_F{i}" for i in order)
    receiver += " " + " ".join(f"1F{i} 1B{i} 1SEND_B{i}" for i in range(m))
    want = (
        r"sends microbatches \.\.\., 3, 4, 5, 6, 7, 8, 9, \.\.\.; rank 1 posts its receives "
        r"\(RECV_F\) for \.\.\., 3, 4, 5, 7, 6, 8, 9, \.\.\."
    )
    with pytest.raises(ScheduleError, match=want):
        xp.validate(sched([sender, receiver], (0, 1), m), rendezvous=False)


@pytest.mark.parametrize("name", sorted(xp.SCHEDULES))
def test_every_generated_schedule_orders_its_edges_alike(name: str) -> None:
    for p, m, v in itertools.product((1, 2, 3, 4), (1, 2, 3, 5, 8), (1, 2, 3)):
        try:
            s = xp.make(name, p, m, chunks=v)
        except ValueError:
            continue  # a size this schedule does not come in
        for x in (s, xp.insert_comms(s), xp.insert_comms(xp.add_stage_ops(s))):
            assert first_misordered(x) is None, (name, p, m, v, x.has_comms)
