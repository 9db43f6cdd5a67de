"""The threads that wait on c10d works for a bounded wait (:class:`Waiter`, :class:`Waiters`).

Split from :mod:`~xgrad.torch_backend.failure`, which waits through them: gloo's
point-to-point works complete only inside an unbounded ``wait()``, so that call runs here
while the caller watches the failure channel against its own deadline. The process's exit
closes the ones still running (:func:`close_running`, from the failure module's exit hook).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any

__all__ = ["Waiter", "Waiters", "close_running"]

_running: set[Waiter] = set()  # those whose thread runs
_lock = threading.Lock()


class Waiter:
    """A daemon thread that calls ``work.wait()`` on the works given to it, in order.

    Gloo's point-to-point works only complete inside ``wait()`` (``is_completed`` stays
    false until then), and a ``wait(timeout)`` that runs out closes gloo's connections,
    so a bounded wait runs the unbounded ``wait()`` on this thread while the caller waits
    on an event, watching the failure channel. Only wait here for a transfer whose other
    side was posted: a receive whose send is known, a send the peer confirmed receiving.
    A thread stuck on a peer that died mid-transfer stays parked; make a new ``Waiter``.
    """

    def __init__(self, name: str = "xgrad-waiter") -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None

    def submit(self, work: Any) -> tuple[threading.Event, list[BaseException]]:
        """Start waiting for ``work``: ``(event set when done, [its error, if any])``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
            with _lock:
                _running.add(self)
        item: tuple[Any, threading.Event, list[BaseException]] = (work, threading.Event(), [])
        self._queue.put(item)
        return item[1], item[2]

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                with _lock:
                    _running.discard(self)
                return
            work, event, error = item
            try:
                work.wait()
            except BaseException as exc:  # handed to the caller
                error.append(exc)
            event.set()

    def close(self) -> None:
        """Let the thread end once the works given so far are done."""
        if self._thread is not None:
            self._queue.put(None)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the thread to end (once closed)."""
        if self._thread is not None:
            self._thread.join(timeout)


class Waiters:
    """The :class:`Waiter` threads of one owner (a pipeline runtime), closed with it.

    An idle waiter's thread ends only once closed, and a runtime is dropped without a
    call (a loop that builds one per experiment): the waiters are closed when ``owner``
    is garbage-collected. Neither they nor their threads refer to the owner, or it would
    never be. :meth:`renew` replaces them (after a failed step, when one may be parked on
    a transfer that never completes); the new ones close with the owner too.
    """

    def __init__(self, owner: object, *names: str) -> None:
        self._names = names
        self._current: tuple[Waiter, ...] = tuple(Waiter(name) for name in names)
        weakref.finalize(owner, self.close)

    def __getitem__(self, index: int) -> Waiter:
        return self._current[index]

    def renew(self) -> None:
        """Close the waiters and use new ones from now on."""
        self.close()
        self._current = tuple(Waiter(name) for name in self._names)

    def close(self) -> None:
        """Let every waiter's thread end once the works given to it are done."""
        for waiter in self._current:
            waiter.close()


def close_running(deadline: float) -> None:
    """Close every running waiter and join their threads against one ``deadline``
    (monotonic): joined one by one with a wait each, many idle runtimes held the exit."""
    with _lock:
        waiters = list(_running)
    for waiter in waiters:
        waiter.close()
    for waiter in waiters:
        waiter.join(max(deadline - time.monotonic(), 1e-3))
