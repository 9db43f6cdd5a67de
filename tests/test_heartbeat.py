"""Heartbeats: a stopped one is named by the waiter, a never-started one at the timeout."""

from __future__ import annotations

import time

import pytest

from xgrad.failure import FailureChannel, MemoryStore, RankUnresponsiveError
from xgrad.failure_wait import wait_until
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
    with pytest.raises(RankUnresponsiveError, match=r"^rank 1: never answered: no heartbeat"):
        wait_until(lambda: False, channel, timeout=0.3, what="recv", poll_interval=0.01)


def test_a_collective_that_times_out_names_the_live_rank_not_in_it() -> None:
    """Ranks 0 and 1 wait in a collective; rank 2 is alive (it beats) but waits for
    nobody, as its heartbeat publishes: it is the one late for the collective."""
    from xgrad.heartbeat import COLLECTIVE

    store = MemoryStore()
    beats = [Heartbeat(store, "hb", r, interval=0.02) for r in (1, 2)]
    store.set("hb/1/waits", str(COLLECTIVE).encode())
    live = Liveness(store, "hb", [1, 2], interval=0.02, timeout=5.0)
    assert live.idle() == [2]
    assert live.end_of_waits(1, 0) == 1  # a collective is not a wait for one rank
    error = FailureChannel(store, "s", 0, live).timed_out("allreduce", 0.5, collective=True)
    assert error.rank == 2 and error.failure.kind == "timeout", error
    assert str(error) == (
        "rank 2: did not answer within the timeout (rank 0 waited for it in the collective): "
        "allreduce timed out after 0.5 s (every rank still answers)"
    )
    # Not a collective: the waiting rank gave up, as before.
    plain = FailureChannel(store, "t", 0, live).timed_out("recv", 0.5)
    assert plain.rank == 0 and str(plain).startswith("rank 0 in recv: timed out"), plain
    for beat in beats:
        beat.stop()


def test_a_wait_that_times_out_names_the_live_rank_its_peers_wait_on() -> None:
    """Rank 0 waited for gradients from ranks 1 and 2; rank 1 waits for rank 3, which is
    alive but waits for nobody (busy in its own code): rank 3 is named, not rank 0."""
    store = MemoryStore()
    beats = [Heartbeat(store, "hb", r, interval=0.02) for r in (1, 2, 3)]
    store.set("hb/1/waits", b"3")
    store.set("hb/2/waits", b"0")  # waits for the waiting rank: no one to follow there
    live = Liveness(store, "hb", [1, 2, 3], interval=0.02, timeout=5.0)
    channel = FailureChannel(store, "s", 0, live)
    error = channel.timed_out("backward, gradients from ranks [2, 1]", 3.0, peers=[2, 1])
    assert error.rank == 3 and error.failure.kind == "timeout", error
    assert str(error) == (
        "rank 3: did not answer within the timeout: rank 0 waited 3 s for it in backward, "
        "gradients from ranks [2, 1] (every rank still answers; it waits for no rank: busy "
        "in its own code, or not there yet)"
    )
    # Every chain back to a waiting rank (a deadlock): the waiting rank gave up.
    store.set("hb/3/waits", b"0")
    plain = FailureChannel(store, "t", 0, live).timed_out("recv", 3.0, peers=[1])
    assert plain.rank == 0 and str(plain).startswith("rank 0 in recv: timed out"), plain
    for beat in beats:
        beat.stop()
