"""Which receives a peer has surely posted when it sends a message (no processes)."""

from __future__ import annotations

import pytest

import xgrad.pipeline as xp
from xgrad.pipeline import Action, Kind

pytest.importorskip("torch")

from xgrad.torch_backend.pipeline_posted import PostedPlan


def test_one_f_one_b_last_rank_posts_forward_receives_ahead_gradients_after_forwards() -> None:
    sched = xp.insert_comms(xp.make("1f1b", 2, 4))
    plan = PostedPlan(sched, window=2)
    actions = list(xp.expand(sched.actions[1]))
    k = plan.sent_at[Action(1, Kind.SEND_B, 0)]
    recvs = [a for a in actions if a.kind is Kind.RECV_F]
    proven = plan.proven(1, Action(1, Kind.SEND_B, 0))
    # The send goes out first: rank 1 had posted every receive of its actions before
    # j + 2, j its last action before the send that is not a send.
    j = max(i for i in range(k) if actions[i].kind not in (Kind.SEND_F, Kind.SEND_B))
    expected = sum(1 for i, a in enumerate(actions) if a.kind is Kind.RECV_F and i < j + 2)
    assert proven == expected and 1 < proven < len(recvs)
    assert plan.frontier[1][k] == plan.frontier[1][k - 1]
    # Rank 0 posts a gradient's receive only once that microbatch's forward ran.
    zero = list(xp.expand(sched.actions[0]))
    for k in range(len(zero)):
        posted = [b for b in zero if b.kind is Kind.RECV_B][: plan.frontier[0][k]]
        for b in posted:
            assert zero.index(Action(0, Kind.FORWARD, b.microbatch)) < k


@pytest.mark.parametrize("name", ["gpipe", "interleaved_1f1b", "zbv", "dualpipev"])
def test_the_frontier_never_counts_a_receive_its_rank_would_not_have_posted(name: str) -> None:
    sched = xp.insert_comms(xp.make(name, 2, 4))
    window = 3
    plan = PostedPlan(sched, window)
    for rank in range(2):
        actions = list(xp.expand(sched.actions[rank]))
        recvs = [(i, a) for i, a in enumerate(actions) if a.kind in (Kind.RECV_F, Kind.RECV_B)]
        for k, count in enumerate(plan.frontier[rank]):
            assert plan.frontier[rank][max(0, k - 1)] <= count  # it only grows
            for i, a in recvs[:count]:
                assert i < k + window
                if a.kind is Kind.RECV_B:
                    assert actions.index(Action(a.stage, Kind.FORWARD, a.microbatch)) < k
        for n, (_, a) in enumerate(recvs):
            assert plan.position[a] == n


@pytest.mark.parametrize(
    ("release", "ahead", "named"),
    [("eager", 8, "release_sends"), ("posted", 0, "post_ahead"), ("gradient", True, "post_ahead")],
)
def test_release_mode_and_window_are_checked_by_name(
    release: object, ahead: object, named: str
) -> None:
    from xgrad.torch_backend.pipeline_posted import check_release

    with pytest.raises(ValueError, match=named):
        check_release(release, ahead)
    check_release("posted", 8)
    check_release("gradient", 1)
