"""Fairscale's invocation model: chains, revisited ranks, reused partitions."""

from __future__ import annotations

import re

import pytest

import xgrad.pipeline as xp
from xgrad.pipeline import Invocation, Location


def test_chain_builds_sources_and_dests() -> None:
    inv = xp.chain([(0, 0), (1, 0), (0, 1)])
    assert inv[0] == Invocation(0, Location(0, 0), None, Location(1, 0))
    assert inv[1] == Invocation(1, Location(1, 0), Location(0, 0), Location(0, 1))
    assert inv[2] == Invocation(2, Location(0, 1), Location(1, 0), None)
    assert xp.placement_of(inv) == (0, 1, 0)
    assert xp.partitions_of(inv) == (Location(0, 0), Location(1, 0), Location(0, 1))


def test_order_can_come_shuffled() -> None:
    inv = xp.chain([(0, 0), (1, 0)])
    assert xp.placement_of(tuple(reversed(inv))) == (0, 1)


def test_broken_chain_is_refused() -> None:
    a, b = xp.chain([(0, 0), (1, 0)])
    with pytest.raises(ValueError, match="source"):
        xp.placement_of([a, b._replace(source=Location(1, 0))])
    with pytest.raises(ValueError, match="orders"):
        xp.placement_of([a, b._replace(order=3)])
    with pytest.raises(ValueError, match="ranks"):
        xp.placement_of(xp.chain([(0, 0), (2, 0)]))
    with pytest.raises(ValueError, match="empty"):
        xp.placement_of([])


@pytest.mark.parametrize("policy", ["gpipe", "1f1b", "zb"])
def test_reused_partition_and_revisited_rank_schedule(policy: str) -> None:
    # Rank 0's partition 0 runs first and third (a shared module); rank 1 runs twice.
    inv = xp.chain([(0, 0), (1, 0), (0, 0), (1, 1)])
    s = xp.from_invocations(inv, 3, policy)
    assert s.placement == (0, 1, 0, 1)
    xp.validate(s)
    xp.validate(xp.insert_comms(s))
    assert xp.simulate(s).bubble_fraction < 1.0


def test_from_invocations_literal() -> None:
    s = xp.from_invocations(xp.chain([(0, 0), (1, 0), (0, 1)]), 2, "gpipe")
    assert [" ".join(map(str, a)) for a in s.actions] == [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
        "1F0 1F1 1B0 1B1",
    ]


def test_from_invocations_chain_matches_formulas() -> None:
    inv = xp.chain([(r, 0) for r in range(4)])
    assert xp.simulate(xp.from_invocations(inv, 8, "1f1b")).bubble_fraction == pytest.approx(3 / 11)
    assert xp.simulate(xp.from_invocations(inv, 8, "zb")).bubble_fraction == pytest.approx(0.0)


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="policy"):
        xp.from_invocations(xp.chain([(0, 0)]), 2, "dfs")


def test_dag_with_skip_connections_across_ranks() -> None:
    # Stage 0 feeds stages 1 and 2; stage 3 joins 2 and 1 (skip connections).
    inv = xp.dag([(0, 0), (1, 0), (2, 0), (0, 1)], [(), (0,), (1, 0), (2, 1)])
    assert inv[2] == Invocation(2, Location(2, 0), Location(1, 0), Location(0, 1), (1, 0))
    assert xp.sources_of(inv) == ((), (0,), (1, 0), (2, 1))
    for policy in ("gpipe", "1f1b", "zb"):
        s = xp.from_invocations(inv, 4, policy)
        assert s.inputs == ((), (0,), (1, 0), (2, 1)) and not s.is_chain
        assert s.consumers(0) == (1, 2) and s.sources(3) == (2, 1)
        xp.validate(s)
        c = xp.insert_comms(s)
        xp.validate(c, rendezvous=False)  # stage 0's send reaches two ranks
        sends = [a for a in c.actions[0] if a.kind is xp.Kind.SEND_F and a.stage == 0]
        assert len(sends) == 4  # one per microbatch, to both consumers
        sim = xp.simulate(s)
        # Stage 3 starts only after both of its inputs.
        spans = {sp.action: sp for r in sim.spans for sp in r}
        f3 = spans[xp.Action(3, xp.Kind.FORWARD, 0)]
        assert f3.start >= spans[xp.Action(2, xp.Kind.FORWARD, 0)].end
        assert f3.start >= spans[xp.Action(1, xp.Kind.FORWARD, 0)].end
    assert "inputs 0;1,0" not in xp.from_invocations(xp.chain([(0, 0), (1, 0)]), 2).text()
    assert "inputs ;0;1,0;2,1" in xp.from_invocations(inv, 2).text()
    # torch's CSV has no place for the inputs: refused, not read back as a chain
    with pytest.raises(ValueError, match=r"not a chain \(stage 2 takes the output of stages"):
        xp.schedule_to_csv(xp.from_invocations(inv, 2))


def test_bad_dags_are_refused() -> None:
    with pytest.raises(ValueError, match="distinct earlier orders"):
        xp.placement_of(xp.dag([(0, 0), (1, 0)], [(), (1,)]))
    with pytest.raises(ValueError, match="used by no later invocation"):
        xp.placement_of(xp.dag([(0, 0), (1, 0), (0, 1)], [(), (0,), (0,)]))
    # Refused by dag() itself: one past the end raised a bare IndexError there, and a
    # negative one read an invocation from the end.
    for bad in ((5,), (-1,), (0, 0)):
        with pytest.raises(ValueError, match=re.escape(f"invocation 1: inputs {bad} must")):
            xp.dag([(0, 0), (1, 0)], [(), bad])
    # It named a "source" mismatch of invocation None, not the input given to invocation 0.
    with pytest.raises(ValueError, match=r"invocation 0 reads the model input: inputs\[0\]"):
        xp.dag([(0, 0), (1, 0)], [(0,), (0,)])
    inv = list(xp.dag([(0, 0), (1, 0), (0, 1)], [(), (0,), (1, 0)]))
    with pytest.raises(ValueError, match="source"):
        xp.placement_of([*inv[:2], inv[2]._replace(source=Location(0, 0))])
    with pytest.raises(ValueError, match="inputs"):
        xp.Schedule(((),), (0,), 1, inputs=((0,),))
