"""A rank's wire plan, worked out once per runtime (no processes): its receives in posting
order, its sends per edge, its peers and which edges go upstream (lane 1)."""

from __future__ import annotations

import pytest

import xgrad.pipeline as xp
from xgrad.pipeline import Kind

pytest.importorskip("torch")

from xgrad.torch_backend.pipeline_route import WirePlan


def test_one_f_one_b_activations_go_down_gradients_up() -> None:
    sched = xp.insert_comms(xp.make("1f1b", 2, 4))
    first, last = WirePlan.of(sched, 0), WirePlan.of(sched, 1)
    assert first.actions == tuple(xp.expand(sched.actions[0]))
    assert [a.kind for _, a in first.recvs] == [Kind.RECV_B] * 4
    assert [a.kind for _, a in last.recvs] == [Kind.RECV_F] * 4
    assert all(first.actions[i] == a for i, a in first.recvs)
    assert first.sends == {(0, 1, 0): 4} and last.sends == {(0, 1, 1): 4}
    assert first.out_edges == ((0, 1),) and first.in_edges == ()
    assert last.in_edges == ((0, 1),) and last.out_edges == ()
    assert first.peers == last.peers | {(0, 1, 0): 1, (0, 1, 1): 1}
    assert last.peers == {(0, 1, 0): 0, (0, 1, 1): 0}
    assert first.upstream == last.upstream == frozenset({(0, 1, 1)})


def test_a_v_schedule_sends_forward_upstream_on_its_way_back() -> None:
    sched = xp.insert_comms(xp.make("zbv", 2, 4))  # stages 0, 3 on rank 0; 1, 2 on rank 1
    plan = WirePlan.of(sched, 1)
    assert set(plan.in_edges) == {(0, 1)} and set(plan.out_edges) == {(2, 3)}
    # Stage 2 (rank 1) to stage 3 (rank 0): a forward going from rank 1 down to rank 0.
    assert (2, 3, 0) in plan.upstream and (2, 3, 1) not in plan.upstream
    assert (0, 1, 1) in plan.upstream and (0, 1, 0) not in plan.upstream
    sends = sum(1 for a in plan.actions if a.kind in (Kind.SEND_F, Kind.SEND_B))
    assert sum(plan.sends.values()) == sends == 8
