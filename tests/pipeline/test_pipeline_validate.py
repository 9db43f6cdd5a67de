"""Validator: each kind of fault is found, named, and marked on the drawn grid."""

from __future__ import annotations

import pytest

import xgrad.pipeline as xp
from xgrad.pipeline import Action, Schedule, ScheduleError


def sched(rows: list[str], placement: tuple[int, ...], m: int) -> Schedule:
    return Schedule(
        tuple(tuple(Action.parse(t) for t in row.split()) for row in rows), placement, m
    )


def fails(s: Schedule, match: str, *, rendezvous: bool = True) -> ScheduleError:
    with pytest.raises(ScheduleError, match=match) as info:
        xp.validate(s, rendezvous=rendezvous)
    return info.value


def test_backward_before_forward_marks_the_step() -> None:
    err = fails(sched(["0F0 0B0", "1B0 1F0"], (0, 1), 1), "1B0 runs before 1F0")
    assert (err.rank, err.step) == (1, 0)
    lines = str(err).splitlines()
    assert lines[1] == "(step = position in each rank's own order, not time)"
    assert lines[2] == "        rank 0  rank 1"
    assert lines[3] == "step 0: 0F0     1B0  <-- rank 1: 1B0 runs before 1F0"
    assert "<--" not in lines[4]


def test_missing_duplicate_and_misplaced() -> None:
    fails(sched(["0F0 0B0", "1F0"], (0, 1), 1), "1B0 is missing from rank 1")
    fails(sched(["0F0 0F0 0B0", "1F0 1B0"], (0, 1), 1), "appears twice")
    fails(sched(["0F0 0B0 1F0", "1B0"], (0, 1), 1), "stage 1 is listed on rank 0, but placement")
    fails(sched(["0F0 0I0 0B0", "1F0 1I0 1W0"], (0, 1), 1), "mixes")
    fails(sched(["0F0 0W0 0I0", "1F0 1I0 1W0"], (0, 1), 1), "0W0 runs before 0I0")


def test_rows_that_contradict_placement_are_named_before_comms_are_placed() -> None:
    """insert_comms used to report them as a deadlock ("cannot place comms")."""
    rows = "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    s = xp.schedule_from_csv(rows, placement=(1, 0))
    want = (
        r"0F0: stage 0 is listed on rank 0, but placement puts it on rank 1 \(placement \[1, 0\]\)"
    )
    with pytest.raises(ScheduleError, match=want) as info:
        xp.insert_comms(s)
    assert (info.value.rank, info.value.step) == (0, 0)
    fails(s, want)


def test_reduce_grad_before_a_backward_of_its_stage_is_refused() -> None:
    """Reduced early, a stage's gradients would stay apart on the replicas, silently."""
    fails(sched(["0REDUCE_GRAD 0F0 0B0", "1F0 1B0"], (0, 1), 1), "0REDUCE_GRAD runs before 0B0")
    early = ["0F0 0F1 0B0 0REDUCE_GRAD 0B1", "1F0 1B0 1F1 1B1"]
    fails(sched(early, (0, 1), 2), "0REDUCE_GRAD runs before 0B1: it must follow every")
    fails(sched(["0F0 0I0 0REDUCE_GRAD 0W0", "1F0 1I0 1W0"], (0, 1), 1), "before 0W0")
    xp.validate(sched(["0F0 0I0 0W0 0REDUCE_GRAD", "1F0 1I0 1W0 1REDUCE_GRAD"], (0, 1), 1))
    for name in ("1f1b", "zb_h1", "interleaved_zb", "dualpipev"):
        xp.validate(xp.insert_comms(xp.add_stage_ops(xp.make(name, 2, 4, chunks=2))))


def test_compute_only_deadlock() -> None:
    # Stage 3 (rank 1) waits for stage 2 (rank 0), which waits for stage 1 queued behind it.
    s = sched(["0F0 2F0 2B0 0B0", "3F0 3B0 1F0 1B0"], (0, 1, 0, 1), 1)
    err = fails(s, "deadlock")
    assert "rank 0 waits at 2F0" in str(err) and "rank 1 waits at 3F0" in str(err)
    assert (err.rank, err.step) == (1, 0)


def test_unmatched_send_and_unreceived_input() -> None:
    fails(sched(["0F0 0SEND_F0 0B0", "1F0 1B0"], (0, 1), 1), "no matching 1RECV_F0")
    rows = ["0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0"]
    fails(sched(rows, (0, 1), 1), "needs 0RECV_B0")
    fails(sched(["0F0 0SEND_B0 0B0", "1F0 1B0"], (0, 1), 1), "sends past the end")


def test_blocking_sends_deadlock_but_buffered_do_not() -> None:
    rows = [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
    ]
    s = sched(rows, (0, 1), 2)
    err = fails(s, "deadlock")
    assert "rank 0 waits at 0SEND_F1" in str(err) and "rank 1 waits at 1SEND_B0" in str(err)
    assert xp.validate(s, rendezvous=False) is s


def test_valid_schedule_is_returned() -> None:
    s = xp.one_f_one_b(3, 4)
    assert xp.validate(s) is s


def test_not_a_schedule() -> None:
    with pytest.raises(TypeError, match="Schedule"):
        xp.validate("1F0")  # type: ignore[arg-type]


def test_schedule_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="microbatch 2"):
        sched(["0F2"], (0,), 2)
    with pytest.raises(ValueError, match="stage 1"):
        sched(["1F0"], (0,), 1)
    with pytest.raises(ValueError, match=r"placement\[0\] = 3"):
        sched(["0F0"], (3,), 1)
    with pytest.raises(ValueError, match="num_microbatches"):
        sched(["0F0"], (0,), 0)


def test_a_w_without_its_i_or_beside_a_b_is_worded_for_what_it_is() -> None:
    # "0F0,0W0" was said to mix a full backward with a split one, with no B anywhere.
    with pytest.raises(xp.ScheduleError, match="0W0 has no I: a split backward's W follows"):
        xp.validate(xp.schedule_from_csv("0F0,0W0"))
    with pytest.raises(xp.ScheduleError, match=r"0W0 mixes full backward \(B\) with split"):
        xp.validate(xp.schedule_from_csv("0F0,0B0,0W0"))


@pytest.mark.parametrize(
    ("rows", "placement", "idle"),
    [
        (["0F0 0B0", "1F0 1B0", ""], (0, 1), 2),  # one rank too many (a blank last CSV row)
        (["0F0 0B0", "", "1F0 1B0"], (0, 2), 1),  # stages placed around a rank
    ],
)
def test_a_rank_that_holds_no_stage_is_refused_naming_it(
    rows: list[str], placement: tuple[int, ...], idle: int
) -> None:
    """torch's schedules build a stage on every rank and xgrad's torch runtime refuses a
    rank without one; validate passed such a schedule, and both simulators counted the idle
    rank into the bubble (two stages, one microbatch on 3 ranks: 0.67 instead of 0.5), for a
    schedule that no runtime runs."""
    s = sched(rows, placement, 1)
    want = (
        rf"rank {idle} holds no stage \(placement \[{', '.join(map(str, placement))}\]\); every "
        "rank of a schedule runs a stage"
    )
    for check in (
        xp.validate,
        lambda s: xp.validate(xp.insert_comms(s)),
        xp.simulate,
        lambda s: xp.simulate_messages(s, lambda a: 1.0),
    ):
        with pytest.raises(ScheduleError, match=want) as info:
            check(s)
        assert (info.value.rank, info.value.step) == (idle, 0)
    # The same schedule without the idle rank is valid.
    kept = sched([r for r in rows if r], (0, 1), 1)
    assert xp.validate(kept) is kept
    assert xp.simulate(kept).bubble_fraction == pytest.approx(0.5)


def test_a_blank_last_row_of_a_csv_is_named_as_an_idle_rank() -> None:
    s = xp.schedule_from_csv("0F0,0B0\n1F0,1B0\n\n")
    assert s.num_ranks == 3  # csv reads the blank row as a rank with no actions
    with pytest.raises(ScheduleError, match="rank 2 holds no stage"):
        xp.validate(s)
