"""A receive waited on the caller's thread, bounded, with a watchdog for a peer that stopped.

Handing a gloo receive to a waiting thread and the message back through a queue costs
the receiving rank a second wake-up on every hop. Waiting on the caller's thread avoids
it, but nothing can interrupt gloo's ``wait()`` from another thread except closing the
group's connections, and a ``wait(timeout)`` that runs out closes them itself. So:

* the wait is ``work.wait(timeout)`` with the context's timeout: it always ends;
* a rank that fails while alive answers every message it owes with a poison header
  (``Inbox.poison``), so a receive from it completes at once; every rank that owes this
  one something is poisoned in turn, so a wait on any peer ends;
* a peer that died makes a receive from it fail at once (gloo: "Connection closed");
* a peer that froze is seen by :class:`_Watchdog`, a daemon thread that, while a wait
  lasts longer than the poll interval, reads the failure channel (its heartbeats) every
  poll interval and, when a peer stopped beating, closes the group's connections (a
  receive of its own from that peer that times out at once), which ends the wait with
  an error; the caller then raises the watchdog's named failure. The group is lost
  then, as it is with a peer gone.

Only a receive from one known peer is waited for so: a gloo receive from any peer is
not failed by a peer's death, nor by closing a connection, only by its own timeout.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeAlias

import torch

from xgrad.failure import FailureChannel, RankError, RankUnresponsiveError, default_seconds
from xgrad.heartbeat import waiting_for
from xgrad.raising import raise_from
from xgrad.torch_backend.dist_wire import SEVER, tag
from xgrad.torch_backend.failure import transfer_failed

__all__ = ["What", "sever", "text", "wait_here"]

#: what a wait is for, in its error messages: the text, or a function that makes it (a
#: wait that ends well never needs it, and making it costs the receiving rank's hop).
What: TypeAlias = str | Callable[[], str]


def text(what: What) -> str:
    """The text of ``what``."""
    return what if isinstance(what, str) else what()


def sever(pg: Any, group_peer: int) -> None:
    """Close ``pg``'s gloo connections: a receive from ``group_peer`` that times out at once."""
    buf = torch.empty(1, dtype=torch.uint8)
    # It raises: the timeout, which closed the connections; or they already were closed.
    with contextlib.suppress(RuntimeError):
        pg.recv([buf], group_peer, tag(0, SEVER)).wait(timedelta(milliseconds=1))


class _Watch:
    """One wait in progress: what the watchdog reads, and what it found."""

    def __init__(self, channel: FailureChannel, pg: Any, group_peer: int) -> None:
        self.channel = channel
        self.pg = pg
        self.group_peer = group_peer
        self.since = time.monotonic()
        self.error: RankError | None = None
        self.thread = threading.get_ident()

    def take_error(self) -> RankError:
        """The watchdog's error, no longer held here: the waiting frame that raises it
        holds this watch, and would hold the error from its own traceback (a cycle; see
        :mod:`xgrad.raising`)."""
        error, self.error = self.error, None
        assert error is not None
        return error


class _Watchdog:
    """The process's watchdog thread: started with the first wait, ends when idle a while."""

    IDLE_EXIT = 5.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: dict[int, _Watch] = {}  # thread id -> its wait
        self._thread: threading.Thread | None = None
        self._last = time.monotonic()

    def begin(self, watch: _Watch) -> None:
        with self._lock:
            self._watches[threading.get_ident()] = watch
            self._last = watch.since
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="xgrad-dist-watchdog", daemon=True
                )
                self._thread.start()

    def end(self) -> None:
        """The wait ended (after the watchdog's closing of the group, if it was under way)."""
        with self._lock:
            self._watches.pop(threading.get_ident(), None)
            self._last = time.monotonic()

    def _run(self) -> None:
        poll = default_seconds("poll_interval")
        while True:
            time.sleep(poll)
            now = time.monotonic()
            with self._lock:
                if not self._watches and now - self._last > self.IDLE_EXIT:
                    self._thread = None
                    return
                watches = [
                    w for w in self._watches.values() if now - w.since >= poll and not w.error
                ]
            # In a call of its own: a local of this loop would hold the last watch (its
            # group, its channel) until the thread ends, seconds after the wait did.
            self._check(watches)
            del watches

    def _check(self, watches: list[_Watch]) -> None:
        for w in watches:
            try:
                w.channel.check()
            except RankUnresponsiveError as exc:  # a peer stopped: free the wait
                with self._lock:  # unless it ended meanwhile; end() waits for this
                    if self._watches.get(w.thread) is w:
                        w.error = exc
                        sever(w.pg, w.group_peer)
            except RankError:
                pass  # posted by a live rank: its poison (or its peers') ends the wait
            except Exception:  # the store itself failed: the timeout still bounds it
                pass


_WATCHDOG = _Watchdog()


def wait_here(
    work: Any,
    channel: FailureChannel,
    pg: Any,
    group_peer: int,
    timeout: float,
    what: What,
    peer: int | None,
) -> None:
    """Wait for a posted receive on this thread, bounded by ``timeout`` and watched.

    ``group_peer`` is the peer's rank within ``pg`` (to close the group's connections);
    ``peer`` its global rank.

    Raises:
        RankError: posted first, naming the rank that stopped answering (a dead or
            frozen peer), or a timeout (``channel.timed_out``).
    """
    watch = _Watch(channel, pg, group_peer)
    _WATCHDOG.begin(watch)
    before = waiting_for(peer)  # published with the heartbeat (FailureChannel.timed_out)
    try:
        work.wait(timedelta(seconds=timeout))
    except Exception as exc:
        waited = time.monotonic() - watch.since
        _WATCHDOG.end()
        if watch.error is not None:
            raise_from(watch.take_error(), exc)
        if waited >= timeout - 0.01:
            peers = () if peer is None else (peer,)
            raise channel.timed_out(text(what), timeout, peers=peers) from exc
        raise transfer_failed(channel, text(what), exc, peer) from exc
    finally:
        waiting_for(before)
    _WATCHDOG.end()
    if watch.error is not None:  # it landed as the watchdog closed the group
        raise watch.take_error()
