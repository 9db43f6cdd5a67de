"""The backend-neutral failure channel: first failure wins, heartbeats, bounded waits."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from xgrad.failure import (
    Failure,
    FailureChannel,
    MemoryStore,
    RankError,
    RankUnresponsiveError,
    check_seconds,
    default_seconds,
    error_for,
)
from xgrad.failure_wait import wait_until


def test_message_names_rank_and_where_first() -> None:
    assert Failure(1, "MulBackward0", "ValueError: boom").text() == (
        "rank 1 in MulBackward0: ValueError: boom"
    )
    assert Failure(1, "comm hook, bucket 0", "x").text() == "rank 1 in comm hook, bucket 0: x"
    assert Failure(1, "", "1F3 failed: x").text() == "rank 1: 1F3 failed: x"
    err = error_for(Failure(2, "", "gone", "unresponsive"), raised_on=0, prefix="Error on ")
    assert isinstance(err, RankUnresponsiveError) and isinstance(err, TimeoutError)
    assert str(err) == "Error on rank 2: gone" and err.rank == 2 and err.raised_on == 0
    f = Failure(3, "w", "m", "timeout")
    assert Failure.from_bytes(f.to_bytes()) == f


def test_first_post_wins_on_every_rank() -> None:
    store = MemoryStore()
    channels = [FailureChannel(store, "step", r) for r in range(4)]
    assert all(c.poll() is None for c in channels)
    first = channels[2].post("AddBackward0", "ValueError: first")
    channels[3].post("MulBackward0", "ValueError: second")
    for c in channels:
        assert c.poll() == first
        with pytest.raises(RankError, match=r"^rank 2 in AddBackward0: ValueError: first$"):
            c.check()
    # Another step's namespace is untouched.
    assert FailureChannel(store, "next", 0).poll() is None


def test_wait_until_raises_a_posted_failure_quickly() -> None:
    store = MemoryStore()
    waiter = FailureChannel(store, "s", 0)
    failer = FailureChannel(store, "s", 1)
    threading.Timer(0.1, lambda: failer.post("node", "boom")).start()
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 in node: boom"):
        wait_until(lambda: False, waiter, timeout=30.0, what="recv", poll_interval=0.01)
    assert time.monotonic() - start < 2.0


class _CountingStore(MemoryStore):
    """A store that counts the lookups made of it (the channel's reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        return super().check(keys)


def test_wait_until_reads_the_channel_only_once_a_wait_lasts() -> None:
    # A wait that ends within a millisecond reads no channel (a store round trip on the
    # forward's path); one that lasts reads it, and still raises a posted failure.
    store = _CountingStore()
    channel = FailureChannel(store, "s", 0)
    landed = iter([False, False, True])
    start = time.monotonic()
    wait_until(lambda: next(landed), channel, timeout=5.0, what="recv")
    # (a loaded machine may stall the wait past the millisecond: then one read is right)
    assert store.checks == 0 or time.monotonic() - start >= 1e-3
    FailureChannel(store, "s", 1).post("node", "boom")
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 in node: boom"):
        wait_until(lambda: False, channel, timeout=5.0, what="recv")
    assert store.checks >= 1 and time.monotonic() - start < 1.0


def test_wait_until_returns_when_done_and_times_out_bounded() -> None:
    flag = threading.Event()
    threading.Timer(0.05, flag.set).start()
    wait_until(flag.is_set, None, timeout=10.0, what="x")
    with pytest.raises(TimeoutError, match=r"recv from rank 3: timed out after 0.2 s"):
        wait_until(lambda: False, None, timeout=0.2, what="recv from rank 3")
    channel = FailureChannel(MemoryStore(), "s", 0)
    with pytest.raises(RankUnresponsiveError, match=r"rank 0 in recv: timed out after 0.2 s"):
        wait_until(lambda: False, channel, timeout=0.2, what="recv")
    assert channel.poll() is not None  # posted, so the peers stop too


def test_seconds_are_checked_and_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"timeout=.* must be a positive, finite"):
            check_seconds("timeout", bad)
    for word in ("soon", "5", True):  # a number in a string is not one either
        with pytest.raises(TypeError, match=r"timeout=.* must be a number of seconds"):
            check_seconds("timeout", word)  # type: ignore[arg-type]
    # torch's form of a timeout counts as its seconds; a zero one is named as given
    assert check_seconds("timeout", timedelta(seconds=2.5)) == 2.5
    with pytest.raises(ValueError, match=r"timeout=datetime.timedelta\(0\) must be a positive"):
        check_seconds("timeout", timedelta(0))
    assert default_seconds("timeout") == 60.0
    monkeypatch.setenv("XGRAD_TIMEOUT", "7.5")
    assert default_seconds("timeout") == 7.5
    monkeypatch.setenv("XGRAD_TIMEOUT", "never")
    with pytest.raises(ValueError, match="XGRAD_TIMEOUT='never'"):
        default_seconds("timeout")


def test_a_ranks_own_exception_is_raised_as_its_type_too() -> None:
    """``except ValueError`` around a DDP forward pass catches what PyTorch's DDP raises
    there; xgrad's step error is also a ValueError on the rank whose code raised it."""
    import pickle

    from xgrad.failure import Failure, RankError, RankUnresponsiveError, error_for
    from xgrad.local_errors import as_local

    failure = Failure(1, "forward", "ValueError: bad batch")
    for cause in (ValueError("bad batch"), KeyError("k"), StopIteration(), OSError(2, "gone")):
        error = as_local(error_for(failure, 0), cause)
        assert isinstance(error, type(cause)) and isinstance(error, RankError)
        assert type(error).__name__ == f"RankError[{type(cause).__name__}]"
        assert str(error) == "rank 1 in forward: ValueError: bad batch"  # not KeyError's repr
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and back.failure == failure and back.raised_on == 0
    assert type(as_local(error_for(failure, 0), ValueError("x"))) is type(
        as_local(error_for(failure, 0), ValueError("y"))
    )
    plain = error_for(failure, 0)
    assert as_local(plain, RuntimeError("r")) is plain  # a RankError is a RuntimeError already
    assert as_local(plain, KeyboardInterrupt()) is plain  # not an Exception: raised as it is
    assert as_local(plain, plain) is plain
    late = as_local(error_for(Failure(1, "", "stopped", "unresponsive"), 0), ValueError("v"))
    assert isinstance(late, RankUnresponsiveError) and isinstance(late, ValueError)


def test_wait_until_is_still_found_where_it_was() -> None:
    """It moved to ``xgrad.failure_wait`` (failure.py past 16 KB); code that imports it
    from ``xgrad.failure`` gets the same function."""
    from xgrad import failure

    assert failure.wait_until is wait_until


def test_a_rank_that_raises_names_every_failure_that_reached_it() -> None:
    """The first post wins, but two ranks failing at once were named as one: a rank names
    the others whose failure is in the store when it raises, once per origin, and no more
    (it does not wait for a ticket whose failure is not written yet)."""
    import pickle

    from xgrad.local_errors import as_local

    store = MemoryStore()
    channels = [FailureChannel(store, "step", r) for r in range(4)]
    assert channels[3].others() == []
    first = channels[1].post("", "1F1 failed: ValueError: one")
    assert FailureChannel(store, "step", 3).others() == []
    channels[2].post("", "2F0 failed: ValueError: two")
    channels[3].relay(first)  # the same origin again, relayed by another rank
    channels[3].post("", "3F0 failed: ValueError: three")  # it knows the first: not posted
    channels[0].post("", "0F2 failed: ValueError: zero")
    assert [f.rank for f in channels[3].others()] == [2, 0]
    error = error_for(first, 3, also=channels[3].others())
    assert str(error) == (
        "rank 1: 1F1 failed: ValueError: one\n"
        "also rank 2: 2F0 failed: ValueError: two\n"
        "also rank 0: 0F2 failed: ValueError: zero"
    )
    for copy in (error, as_local(error, ValueError("one"))):
        back = pickle.loads(pickle.dumps(copy))
        assert type(back) is type(copy) and str(back) == str(error) and back.also == error.also
    store.add("step/failures", 1)  # a ticket taken, its failure not written yet
    store.set("step/failure/7", Failure(3, "", "after the gap").to_bytes())
    assert [f.rank for f in channels[3].others()] == [2, 0]
