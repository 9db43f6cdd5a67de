"""Heartbeats: a stopped one is named by the waiter, a never-started one at the timeout."""

from __future__ import annotations

import time

import pytest

from xgrad.failure import FailureChannel, MemoryStore, RankUnresponsiveError, wait_until
from xgrad.heartbeat import Heartbeat, Liveness


def test_a_stopped_heartbeat_is_named() -> None:
    store = MemoryStore()
    beats = [Heartbeat(store, "hb", r, interval=0.02) for r in (1, 2)]
    live = Liveness(store, "hb", [1, 2], interval=0.01, timeout=0.3)
    channel = FailureChannel(store, "s", 0, live)
    beats[1].stop()
    start = time.monotonic()
    with pytest.raises(RankUnresponsiveError, match=r"^rank 2: stopped answering") as info:
        wait_until(lambda: False, channel, timeout=20.0, what="recv", poll_interval=0.01)
    assert info.value.rank == 2
    assert time.monotonic() - start < 5.0
    beats[0].stop()


def test_a_rank_that_never_beat_is_named_at_the_timeout() -> None:
    store = MemoryStore()
    live = Liveness(store, "hb", [1], interval=0.01, timeout=100.0)
    channel = FailureChannel(store, "s", 0, live)
    with pytest.raises(RankUnresponsiveError, match=r"^rank 1: stopped answering"):
        wait_until(lambda: False, channel, timeout=0.3, what="recv", poll_interval=0.01)
