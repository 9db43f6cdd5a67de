"""Passes: sends and receives inserted, literal for 1F1B, and no deadlock under blocking p2p."""

from __future__ import annotations

import pytest

import xgrad.pipeline as xp
from xgrad.pipeline import Action


def test_insert_comms_literal_1f1b() -> None:
    s = xp.insert_comms(xp.one_f_one_b(2, 2))
    assert [" ".join(map(str, a)) for a in s.actions] == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
    ]
    xp.validate(s, rendezvous=True)


def test_same_rank_neighbours_need_no_comms() -> None:
    s = xp.from_invocations(xp.chain([(0, 0), (0, 1), (1, 0)]), 1, "gpipe")
    c = xp.insert_comms(s)
    assert [str(a) for a in c.actions[0]] == ["0F0", "1F0", "1SEND_F0", "1RECV_B0", "1B0", "0B0"]


@pytest.mark.parametrize("name", sorted(xp.SCHEDULES))
@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8)])
def test_every_schedule_gets_deadlock_free_comms(name: str, p: int, m: int) -> None:
    s = xp.make(name, p, m)
    c = xp.insert_comms(s)
    xp.validate(c, rendezvous=True)
    sends = sum(a.kind.name.startswith("SEND") for acts in c.actions for a in acts)
    recvs = sum(a.kind.name.startswith("RECV") for acts in c.actions for a in acts)
    crossings = sum(s.placement[i] != s.placement[i + 1] for i in range(s.num_stages - 1))
    assert sends == recvs == 2 * crossings * m
    assert xp.strip_comms(c) == s
    assert xp.simulate(c) == xp.simulate(s)


def test_insert_twice_is_refused() -> None:
    c = xp.insert_comms(xp.gpipe(2, 1))
    with pytest.raises(ValueError, match="already has sends"):
        xp.insert_comms(c)


def test_unschedulable_compute_order_is_drawn() -> None:
    s = xp.Schedule(
        (
            tuple(map(Action.parse, ["0F0", "2F0", "2B0", "0B0"])),
            tuple(map(Action.parse, ["3F0", "3B0", "1F0", "1B0"])),
        ),
        (0, 1, 0, 1),
        1,
    )
    with pytest.raises(xp.ScheduleError, match="cannot place comms"):
        xp.insert_comms(s)


def test_add_stage_ops_places_them_as_torch_does() -> None:
    s = xp.add_stage_ops(xp.zb_h1(2, 2))
    assert [str(a) for a in s.actions[1]] == [
        "1UNSHARD",
        "1F0",
        "1I0",
        "1F1",
        "1I1",
        "1W0",
        "1W1",
        "1REDUCE_GRAD",
        "1RESHARD",
    ]
    xp.validate(xp.insert_comms(s))
    assert xp.strip_comms(s) == xp.zb_h1(2, 2)
    with pytest.raises(ValueError, match="already has stage-level actions"):
        xp.add_stage_ops(s)


@pytest.mark.parametrize(
    ("rank0", "message"),
    [
        (["0UNSHARD", "0F0", "0B0", "0UNSHARD"], "stage 0 is unsharded already"),
        (["0UNSHARD", "0F0", "0RESHARD", "0RESHARD", "0B0"], "stage 0 is not unsharded"),
        (["0UNSHARD", "0F0", "0RESHARD", "0B0"], "0B0 runs while stage 0 is resharded"),
        (["0UNSHARD", "0F0", "0B0", "0REDUCE_GRAD", "0REDUCE_GRAD"], "appears twice"),
    ],
)
def test_shard_ops_alternate_and_enclose_the_passes(rank0: list[str], message: str) -> None:
    s = xp.Schedule((tuple(map(Action.parse, rank0)),), (0,), 1)
    with pytest.raises(xp.ScheduleError, match=message):
        xp.validate(s)
    # A stage resharded and unsharded again between its passes is fine.
    again = ["0UNSHARD", "0F0", "0RESHARD", "0UNSHARD", "0B0", "0RESHARD"]
    xp.validate(xp.Schedule((tuple(map(Action.parse, again)),), (0,), 1))
