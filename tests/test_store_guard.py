"""GuardedStore: every call answered within its timeout, or raised naming the store's host."""

from __future__ import annotations

import threading
import time

import pytest

from xgrad.failure import MemoryStore, RankUnresponsiveError
from xgrad.store_guard import GuardedStore


class _Freezable(MemoryStore):
    """A store whose calls block while ``frozen`` is clear, as a frozen host's do."""

    def __init__(self) -> None:
        super().__init__()
        self.running = threading.Event()
        self.running.set()
        self.calls: list[str] = []

    def add(self, key: str, amount: int) -> int:
        self.running.wait()
        self.calls.append(f"add {key}")
        return super().add(key, amount)

    def check(self, keys: list[str]) -> bool:
        self.running.wait()
        return super().check(keys)

    def close(self) -> None:
        raise ConnectionResetError("Connection reset by peer")

    greeting = "hello"

    def echo(self, *args: object) -> tuple[object, ...]:
        return args


def _guard(store: _Freezable, timeout: float = 0.3, host: int | None = 0) -> GuardedStore:
    return GuardedStore(store, timeout=timeout, me=2, host=host, address="store at A")


def test_calls_pass_through_and_answer() -> None:
    store = _Freezable()
    guard = _guard(store)
    guard.set("k", b"v")
    assert guard.get("k") == b"v"
    assert guard.add("n", 2) == 2 and guard.add("n", 3) == 5
    assert guard.check(["k"]) and not guard.check(["missing"])
    assert guard.delete_key("k") and not guard.check(["k"])
    assert guard.echo(1, "x") == (1, "x")  # other methods are guarded too
    assert guard.greeting == "hello"  # plain attributes are the store's
    with pytest.raises(KeyError):
        guard.get("missing")  # the store's own errors come back as they are


def test_a_frozen_host_is_named_within_the_timeout_and_at_once_after() -> None:
    store = _Freezable()
    guard = _guard(store, timeout=0.3)
    store.running.clear()
    start = time.monotonic()
    with pytest.raises(RankUnresponsiveError) as info:
        guard.add("n", 1)
    assert 0.25 < time.monotonic() - start < 2.0
    assert info.value.rank == 0 and info.value.raised_on == 2
    assert str(info.value).startswith(
        "rank 0: stopped answering: the store it hosts (store at A) did not answer store.add"
    ), str(info.value)
    time.sleep(0.35)  # the stuck call is older than the timeout: no second wait
    start = time.monotonic()
    with pytest.raises(RankUnresponsiveError):
        guard.check(["n"])
    assert time.monotonic() - start < 0.1


def test_the_store_works_again_once_the_host_resumes_and_abandoned_writes_do_not_land() -> None:
    store = _Freezable()
    guard = _guard(store, timeout=0.2)
    store.running.clear()
    with pytest.raises(RankUnresponsiveError):
        guard.add("first", 1)  # on the guard's thread, stuck
    with pytest.raises(RankUnresponsiveError):
        guard.add("queued", 1)  # waits behind it, given up
    store.running.set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            assert guard.add("after", 1) == 1
            break
        except RankUnresponsiveError:
            time.sleep(0.05)
    assert "add queued" not in store.calls  # given up before it ran: never applied
    assert store.calls[-1] == "add after"


def test_a_lost_connection_is_named_as_the_host_gone() -> None:
    guard = _guard(_Freezable())
    with pytest.raises(RankUnresponsiveError) as info:
        guard.close()
    text = str(info.value)
    assert text.startswith("rank 0: stopped answering: the store it hosts (store at A) is gone")
    assert "store.close by rank 2 failed: ConnectionResetError: Connection reset by peer" in text
    assert isinstance(info.value.__cause__, ConnectionResetError)


def test_without_a_hosting_rank_the_asking_rank_is_named() -> None:
    store = _Freezable()
    guard = _guard(store, timeout=0.2, host=None)
    store.running.clear()
    with pytest.raises(RankUnresponsiveError) as info:
        guard.check(["x"])
    store.running.set()
    assert str(info.value).startswith("rank 2 in store: stopped answering: the store (store at A)")
