"""The simulated link: one message at a time, each the ring time after the previous."""

from __future__ import annotations

import time

import pytest

from xgrad.link import SimulatedLink, make_link
from xgrad.reference.clock import LinkModel


def test_messages_queue_on_the_link() -> None:
    link = SimulatedLink(LinkModel(1e-3, 1e-6), world_size=2)
    one = link.seconds(1000)
    assert one == pytest.approx(2e-3 + 1e-3)
    first = link.reserve(1000, now=10.0)
    second = link.reserve(1000, now=10.0)  # issued at once: waits for the first
    third = link.reserve(1000, now=100.0)  # the link is idle again
    assert (first, second, third) == pytest.approx((10.0 + one, 10.0 + 2 * one, 100.0 + one))
    assert link.messages == 3 and link.bytes == 3000


def test_wait_sleeps_for_the_modelled_time() -> None:
    link = SimulatedLink(LinkModel(0.02, 0.0), world_size=2)
    start = time.perf_counter()
    link.wait(10)
    assert time.perf_counter() - start >= 0.04 * 0.99
    with pytest.raises(ValueError, match="world_size=0"):
        SimulatedLink(LinkModel(0.0, 0.0), world_size=0)


def test_make_link_is_simulated_only_for_sim() -> None:
    link = make_link("sim", 1e-3, 1e-6, 4)
    assert link is not None and link.world_size == 4
    assert link.model == LinkModel(1e-3, 1e-6)
    assert make_link("real", 1e-3, 1e-6, 4) is None
