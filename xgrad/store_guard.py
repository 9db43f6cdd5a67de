"""A key-value store whose every call is bounded: a frozen store host cannot hang a rank.

The failure channel, the heartbeats and every step's bookkeeping go through a shared
store. When that store is served by one of the ranks (c10d's ``TCPStore``, which rank 0
hosts when a group is started without ``torchrun``), a frozen rank 0 (SIGSTOP, a debugger,
a swapped-out machine) freezes the store with it, and a store call on any other rank
blocks for ever: c10d's client bounds only some of its calls by the store's timeout, and
``add`` or ``check`` wait for the answer without one. The very reads that were to name a
frozen rank then hung every peer.

:class:`GuardedStore` makes each call on a thread of its own and waits for the answer at
most ``timeout`` seconds. Past that the store is taken as lost: the call raises a
:class:`~xgrad.failure.RankUnresponsiveError` naming the host, and so does every later
call, at once (no second wait), until a call is answered again. That conclusion is the
guard's own state, set by the caller that gave up: the stuck call ending on the client's
own timeout (an error: the host still does not answer) does not undo it, and neither
does a call that merely started late. A host that died makes the client raise its own
connection errors; those are raised named too. When a frozen host resumes, the stuck call
returns (or, if it ended already, a read-only probe the guard sends in its place does)
and the store works again.

Each call costs a thread hand-off (about 20 µs on an idle core), so the torch backend
guards only stores a rank hosts (a file store has no host to freeze). Backend-neutral:
written against :class:`~xgrad.failure.KeyValueStore`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from xgrad.failure import Failure, RankError, error_for

__all__ = ["GuardedStore"]


#: the key the guard's probe asks about (:meth:`GuardedStore._probe`): read, never written.
_PROBE_KEY = "xgrad/store_guard/probe"


class _Call:
    """One call handed to the guard's thread, and what came of it."""

    __slots__ = ("args", "done", "error", "fn", "given_up", "queued", "result", "started")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.given_up = False
        #: when its caller began to wait (the host has been silent at least since then
        #: when the wait runs out), and when the guard's thread took it (None: not yet).
        self.queued = time.monotonic()
        self.started: float | None = None


class GuardedStore:
    """``store``'s calls, each answered within ``timeout`` seconds or raised as the host lost.

    Args:
        store: the store (``set``, ``get``, ``add``, ``check``, ``delete_key`` and whatever
            else it has; other attributes are passed through, their calls guarded).
        timeout: seconds a call may take before the host is declared unresponsive (the
            heartbeat timeout: a store that does not answer for that long is as lost as a
            rank that does not beat for that long).
        me: this process's rank (it raises the error).
        host: the rank whose process serves the store; None when no rank does (a launcher's
            agent), then the error starts with ``me``.
        address: how the error names the store (``"TCPStore 127.0.0.1:29500"``).
        gone: the exception types with which the store's client reports a host that went
            away (a closed connection); raised named as the host lost.
    """

    def __init__(
        self,
        store: Any,
        *,
        timeout: float,
        me: int,
        host: int | None,
        address: str,
        gone: tuple[type[BaseException], ...] = (ConnectionError,),
    ) -> None:
        self.inner = store
        self.timeout = timeout
        self.me = me
        self.host = host
        self.address = address
        self.gone = gone
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        # The state below is shared by the callers and the guard's thread, under _lock.
        # Each piece is cleared only by what it is about: the thread clears _running and
        # _probe_call for the call it ran, and only an answer clears _lost_since.
        self._lock = threading.Lock()
        #: the call now running on the guard's thread (None: idle).
        self._running: _Call | None = None
        #: since when the host is known not to answer (set when a wait runs out); None
        #: while it answers. Cleared only by a call that returns: a stuck call that ends
        #: on the client's own timeout has not heard from the host.
        self._lost_since: float | None = None
        #: the client's own "connection closed" seen while lost: the host is gone, not silent.
        self._gone_error: BaseException | None = None
        #: the probe queued or running (:meth:`_probe`), one at a time.
        self._probe_call: _Call | None = None

    # The KeyValueStore protocol, spelled out (the failure channel's hot calls).
    def set(self, key: str, value: bytes) -> None:
        self.call("set", self.inner.set, key, value)

    def get(self, key: str) -> bytes:
        return self.call("get", self.inner.get, key)  # type: ignore[no-any-return]

    def add(self, key: str, amount: int) -> int:
        return self.call("add", self.inner.add, key, amount)  # type: ignore[no-any-return]

    def check(self, keys: list[str]) -> bool:
        return self.call("check", self.inner.check, keys)  # type: ignore[no-any-return]

    def delete_key(self, key: str) -> bool:
        return self.call("delete_key", self.inner.delete_key, key)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value):
            return value
        return lambda *args: self.call(name, value, *args)

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the guard's thread, waited for at most ``timeout`` seconds; at once
        the host's error when it is already known not to answer."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        item = _Call(fn, args)
        with self._lock:
            known = self._known_lost(what, item.queued)
        if known is not None:
            raise known[0] from known[1]  # no second wait
        self._start()
        self._queue.put(item)
        if not item.done.wait(self.timeout):
            with self._lock:
                if not item.done.is_set():  # (answered in this instant: taken below)
                    item.given_up = True
                    if self._lost_since is None:
                        self._lost_since = item.queued
                    raise self._lost(what, self.timeout)
        error, result = item.error, item.result
        del item  # not on the traceback of what is raised (no cycle through this frame)
        if error is None:
            return result
        try:
            if isinstance(error, self.gone):
                raise self._gone(what, error) from error
            raise error
        finally:
            del error

    def _known_lost(self, what: str, now: float) -> tuple[RankError, BaseException | None] | None:
        """Under ``_lock``: the error to raise at once (and its cause) when the host is
        known not to answer, else None (the call is to be made).

        Known when a wait ran out before, or when the call on the guard's thread has run
        for the timeout already (its caller has not woken to give up yet).
        """
        running = self._running
        if (
            self._lost_since is None
            and running is not None
            and running.started is not None
            and now - running.started >= self.timeout
        ):
            self._lost_since = running.started
        if self._lost_since is None:
            return None
        self._probe()
        gone = self._gone_error
        if gone is not None:
            return self._gone(what, gone), gone
        return self._lost(what, now - self._lost_since), None

    def _probe(self) -> None:
        """Under ``_lock``, the host known lost: with no call of its own in flight (the
        stuck one ended on the client's timeout), send a read-only ``check`` that clears
        the loss once the host answers. Else the store would stay lost for good, as calls
        fail without being sent."""
        if self._running is None and self._probe_call is None:
            self._probe_call = probe = _Call(self.inner.check, ([_PROBE_KEY],))
            self._start()
            self._queue.put(probe)

    def _start(self) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    thread = threading.Thread(target=self._run, name="xgrad-store", daemon=True)
                    thread.start()
                    self._thread = thread

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            with self._lock:
                if item.given_up:  # its caller raised already: a stale write must not land later
                    continue
                item.started = time.monotonic()
                self._running = item
            try:
                item.result = item.fn(*item.args)
            except BaseException as exc:  # handed to the caller
                item.error = exc
            with self._lock:
                self._running = None
                if item is self._probe_call:
                    self._probe_call = None
                if item.error is None:  # the host answered: the store works again
                    self._lost_since = self._gone_error = None
                elif self._lost_since is not None and isinstance(item.error, self.gone):
                    self._gone_error = item.error.with_traceback(None)
                item.done.set()  # under the lock: a caller giving up sees it or is seen

    def _failure(self, happened: str) -> RankError:
        """``rank H: stopped answering: the store it hosts (ADDRESS) HAPPENED``, raised on me."""
        whose = "the store it hosts" if self.host is not None else "the store"
        message = f"stopped answering: {whose} ({self.address}) {happened}"
        if self.host is None:
            return error_for(Failure(self.me, "store", message, "unresponsive"), self.me)
        return error_for(Failure(self.host, "", message, "unresponsive"), self.me)

    def _lost(self, what: str, seconds: float) -> RankError:
        return self._failure(
            f"did not answer store.{what} for {seconds:.3g} s, asked by rank {self.me}"
        )

    def _gone(self, what: str, exc: BaseException) -> RankError:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return self._failure(
            f"is gone: store.{what} by rank {self.me} failed: {type(exc).__name__}: {text}"
        )
