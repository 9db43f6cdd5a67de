"""Fairscale's invocation model: chains, revisited ranks, reused partitions."""

from __future__ import annotations

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
