"""The pipeline runtime's construction-time checks, without a process group."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
import torch

from xgrad.pipeline import (
    Kind,
    add_stage_ops,
    chain,
    dag,
    from_invocations,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    schedule_from_csv,
)
from xgrad.torch_backend.pipeline_args import (
    check_modules,
    check_settings,
    reduce_points,
    runtime_schedule,
    slot_map,
)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "5", None, timedelta(seconds=-1)])
def test_a_timeout_that_is_not_positive_finite_seconds_is_named(bad: object) -> None:
    with pytest.raises(
        ValueError, match=re.escape(f"timeout must be positive finite seconds, got {bad!r}")
    ):
        check_settings("never", bad)


def test_an_unknown_checkpoint_mode_is_named() -> None:
    with pytest.raises(ValueError, match=r"checkpoint must be one of .* got 'sometimes'"):
        check_settings("sometimes", 1.0)
    assert check_settings("always", 2) == 2.0
    assert check_settings("always", timedelta(seconds=90)) == 90.0  # torch's form of a timeout


def test_the_schedule_must_have_the_groups_size_and_gets_its_comms() -> None:
    with pytest.raises(ValueError, match="rank 1: schedule has 2 ranks, the group 3"):
        runtime_schedule(gpipe(2, 4), 1, 3)
    plain = one_f_one_b(2, 4)
    assert not plain.has_comms
    ran = runtime_schedule(plain, 0, 2)
    assert ran.has_comms
    kinds = {a.kind for a in ran.actions[0]}
    assert Kind.SEND_F in kinds and Kind.RECV_B in kinds


def test_a_rank_with_no_stage_is_named_on_every_rank() -> None:
    """It used to crash the step on that rank with a bare "min() arg is an empty sequence"
    (and leave the others waiting for it)."""
    idle = schedule_from_csv("0F0,1F0,0F1,1F1,1B0,0B0,1B1,0B1\n\n")
    for rank in (0, 1):
        with pytest.raises(
            ValueError,
            match=rf"rank {rank}: the schedule places no stage on rank 1 \(placement \[0, 0\]\)",
        ):
            runtime_schedule(idle, rank, 2)


def test_slots_follow_the_ranks_stages_and_must_exist() -> None:
    sched = interleaved_1f1b(2, 4, chunks=2)  # rank 0 holds stages 0 and 2
    assert slot_map(sched, ["a", "b"], None, 0) == {0: 0, 2: 1}
    with pytest.raises(ValueError, match=r"rank 1: needs partitions for slots \[0, 1\], got 1"):
        slot_map(sched, ["a"], None, 1)
    # One partition too many (a whole nn.Sequential passed as the list): its layers would
    # silently run nowhere.
    with pytest.raises(ValueError, match=r"rank 0: the schedule runs partitions \[0, 1\] .*\[2\]"):
        slot_map(sched, ["a", "b", "c"], None, 0)
    with pytest.raises(
        TypeError, match=r"rank 1: partition 1 is a function, not a torch\.nn\.Module"
    ):
        check_modules([torch.nn.Linear(1, 1), lambda t: t], 1)
    with pytest.raises(TypeError, match=r"schedule must be an xgrad\.pipeline\.Schedule"):
        runtime_schedule("gpipe", 0, 2)  # type: ignore[arg-type]


def test_invocations_and_schedule_must_feed_the_stages_alike() -> None:
    """A chain schedule with a DAG's invocations used to run the DAG as a chain: the skip
    connections dropped, every gradient silently wrong (no error on any rank)."""
    locations = [(0, 0), (1, 0), (2, 0), (3, 0)]
    skips = dag(locations, [(), (0,), (1, 0), (2, 0)])
    with pytest.raises(ValueError, match=r"rank 0: invocations feed the stages from .*\(1, 0\)"):
        slot_map(one_f_one_b(4, 4), ["a"], skips, 0)
    with pytest.raises(ValueError, match="rank 1: invocations feed the stages from"):
        slot_map(from_invocations(skips, 4), ["a"], chain(locations), 1)
    assert slot_map(from_invocations(skips, 4), ["a"], skips, 2) == {0: 0, 1: 0, 2: 0, 3: 0}
    assert slot_map(one_f_one_b(4, 4), ["a"], chain(locations), 3) == {0: 0, 1: 0, 2: 0, 3: 0}


def test_a_partition_is_reduced_at_its_last_reduce_grad() -> None:
    sched = add_stage_ops(interleaved_1f1b(2, 4, chunks=2))
    slots = slot_map(sched, ["a", "b"], None, 0)
    assert reduce_points(sched, 0, slots) == {0: 0, 1: 2}
    assert reduce_points(one_f_one_b(2, 4), 0, {0: 0}) == {}
