"""GuardedStore: every call answered within its timeout, or raised naming the store's host."""

from __future__ import annotations

import queue
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


class _LateQueue(queue.SimpleQueue):  # type: ignore[type-arg]
    """The guard's queue, its thread taking each call ``late`` seconds after it was queued:
    a thread woken late on a loaded machine (two cores shared by three ranks in CI)."""

    late = 0.2

    def get(self, block: bool = True, timeout: float | None = None) -> object:
        item = super().get(block, timeout)
        time.sleep(self.late)
        return item


def test_a_call_given_up_before_the_guard_thread_ran_it_fails_the_next_call_at_once() -> None:
    """The CI failure of test_store_host's "again" step (2.0 s for under 1 s): the guard
    judged the next call by how long the stuck call had *run*, which is shorter than its
    caller had *waited* when the guard's thread took it late; the next call, made within
    that difference of the give-up, was queued behind the stuck one and waited the full
    timeout again."""
    store = _Freezable()
    guard = _guard(store, timeout=0.3)
    guard._queue = _LateQueue()  # queued at t, run from t + 0.2, given up at t + 0.3
    store.running.clear()
    with pytest.raises(RankUnresponsiveError):
        guard.add("n", 1)
    start = time.monotonic()
    with pytest.raises(RankUnresponsiveError) as info:
        guard.check(["n"])
    assert time.monotonic() - start < 0.1  # not a second wait
    assert "did not answer store.check" in str(info.value)
    store.running.set()


class _Host(MemoryStore):
    """A store whose host the test freezes: a call blocks until the test ends it as c10d's
    client would while the host stays frozen (:meth:`expire`: its own timeout error), or
    the host resumes (:meth:`resume`)."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition()
        self.frozen = True
        self._expiring = 0
        #: the calls that reached the host (blocked there or answered), in order.
        self.entered: list[str] = []

    def _answer(self, what: str) -> None:
        with self._cond:
            self.entered.append(what)
            self._cond.notify_all()
            while self.frozen:
                if self._expiring:
                    self._expiring -= 1
                    raise RuntimeError("Socket Timeout")  # c10d's DistStoreError is one
                self._cond.wait()

    def expire(self) -> None:
        """End one stuck call with the client's own timeout; the host stays frozen."""
        with self._cond:
            self._expiring += 1
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self.frozen = False
            self._cond.notify_all()

    def wait_entered(self, what: str) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: what in self.entered, 5.0), self.entered

    def add(self, key: str, amount: int) -> int:
        self._answer(f"add {key}")
        return super().add(key, amount)

    def check(self, keys: list[str]) -> bool:
        self._answer(f"check {keys}")
        return super().check(keys)


class _Watched(queue.SimpleQueue):  # type: ignore[type-arg]
    """The guard's queue, telling when the guard's thread is back waiting for a call (the
    one before it is wholly done: the guard has taken in how it ended)."""

    def __init__(self) -> None:
        self.idle = threading.Event()

    def get(self, block: bool = True, timeout: float | None = None) -> object:
        self.idle.set()
        item = super().get(block, timeout)
        self.idle.clear()
        return item


def _works_again(guard: GuardedStore, key: str) -> None:
    deadline = time.monotonic() + 5
    while True:
        try:
            assert guard.add(key, 1) == 1
            return
        except RankUnresponsiveError:
            assert time.monotonic() < deadline, "the store never worked again"
            time.sleep(0.05)


def test_a_given_up_call_ended_by_the_clients_timeout_does_not_make_the_next_call_wait() -> None:
    """The given-up call ends later on c10d's own timeout (an error: the host still does
    not answer); its end must not undo the guard's conclusion, so the next call fails at
    once, and the store is used again only once the host answers."""
    host = _Host()
    guard = _guard(host, timeout=0.3)  # type: ignore[arg-type]
    watched = _Watched()
    guard._queue = watched
    with pytest.raises(RankUnresponsiveError):
        guard.add("a", 1)  # call A: stuck, given up
    start = time.monotonic()
    with pytest.raises(RankUnresponsiveError):
        guard.check(["b"])  # call B, while A is stuck: at once
    assert time.monotonic() - start < 0.1
    watched.idle.clear()
    host.expire()  # A's client times out; the host is still frozen
    assert watched.idle.wait(5.0)
    start = time.monotonic()
    with pytest.raises(RankUnresponsiveError) as info:
        guard.check(["c"])  # call C
    assert time.monotonic() - start < 0.1, "a second full wait on a host known not to answer"
    assert str(info.value).startswith("rank 0: stopped answering: the store it hosts (store at A)")
    assert "check ['c']" not in host.entered  # never sent to the frozen host
    host.resume()
    _works_again(guard, "after")


def test_an_old_calls_end_does_not_clear_what_a_newer_call_in_flight_needs() -> None:
    """Two calls in flight: A stuck, B queued behind it by another thread. A is given up,
    then ends on c10d's timeout, and B starts on the still frozen host: a call C made then
    must see the host as lost (A's end does not reset it), not wait behind B."""
    host = _Host()
    guard = _guard(host, timeout=1.0)  # type: ignore[arg-type]
    outcome: list[object] = []

    def call_b() -> None:
        try:
            outcome.append(guard.add("b", 1))
        except RankUnresponsiveError as exc:
            outcome.append(exc)

    done_a = threading.Event()

    def call_a() -> None:
        with pytest.raises(RankUnresponsiveError):
            guard.add("a", 1)
        done_a.set()

    a = threading.Thread(target=call_a)
    a.start()
    host.wait_entered("add a")
    time.sleep(0.5)  # B's caller still waits when A is given up (half a timeout later)
    b = threading.Thread(target=call_b)
    b.start()  # queued behind A, its caller waiting
    assert done_a.wait(5.0)  # A given up
    host.expire()
    host.wait_entered("add b")  # A ended; B runs on the frozen host
    start = time.monotonic()
    with pytest.raises(RankUnresponsiveError):
        guard.check(["c"])
    assert time.monotonic() - start < 0.1, "a second full wait on a host known not to answer"
    host.resume()
    a.join(5.0)
    b.join(5.0)
    assert len(outcome) == 1  # B's wait was bounded: answered, or given up in time
    _works_again(guard, "after")
