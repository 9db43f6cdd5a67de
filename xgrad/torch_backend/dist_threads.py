"""The per-peer waiting threads of distributed backward passes, and their release at exit.

Where a rank cannot wait for its messages on its own thread (gradients that may come
from several peers first; ``dist_inbox.WAIT = "threads"``), one daemon thread per peer
waits that peer's posted receives in order and hands each completion to the pass's
queue. After a failure, a thread of its own waits out the receives a pass left posted
(:func:`_drain`). A thread still blocked at exit (a frozen peer) is freed by closing its
group's connections (:func:`_release_at_exit`).
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import Any

import torch

from xgrad.torch_backend.dist_watch import sever
from xgrad.torch_backend.dist_wire import Link

__all__ = ["Message"]

#: (peer, index of the message from that peer, buffer, the wait's error or None)
Message = tuple[int, int, torch.Tensor, BaseException | None]


class _PeerThread:
    """A daemon thread that waits one peer's posted receives, in order, for pass after pass."""

    def __init__(self, link: Link, *, drain: bool = False) -> None:
        self.pg = link.pg
        self.group_peer = link.group_peer
        self.drain = drain
        self.waiting = False
        self.stream: Any = None
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        name = f"xgrad-inbox-{link.peer}"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            peer, works, out = job
            for i, (work, buf) in enumerate(works):
                error = self._caught(work, buf)
                out.put((peer, i, buf, error))
                # gloo: the peer died; the rest cannot come (a drain waits each out: each
                # fails at once then, and is done with).
                if error is not None and not self.drain:
                    break

    def _caught(self, work: Any, buf: torch.Tensor) -> BaseException | None:
        """Wait for one receive; the error it raised (without its traceback), or None.

        The error goes to the pass as data (its type and text name the failure). Its
        traceback would lead (through ``f_back``) to the frame that holds the pass's queue,
        which holds the error: a reference cycle, kept until the garbage collector runs
        when nobody reads the queue (a drain's, a pass that stopped reading).
        """
        self.waiting = True
        try:
            self._wait(work, buf)
        except BaseException as exc:
            return exc.with_traceback(None)
        finally:
            self.waiting = False
        return None

    def _wait(self, work: Any, buf: torch.Tensor) -> None:
        """Block until the receive into ``buf`` completed.

        On NCCL ``wait()`` only orders the current CUDA stream after the receive, so the
        thread waits on a stream of its own and then synchronizes it (the receives must be
        seen in the order they land, whichever peer sent first).
        """
        if not buf.is_cuda:
            work.wait()
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(buf.device)
        with torch.cuda.stream(self.stream):
            work.wait()
        self.stream.synchronize()


#: one waiting thread per (group, peer, calling thread), reused by the passes of every
#: context: one caller's passes run one after the other, so their receives complete in
#: the order they were posted; two callers' passes on one group may not.
_threads: dict[tuple[str, int, int], _PeerThread] = {}
#: every thread made, retired ones too (for :func:`_release_at_exit`).
_made: list[_PeerThread] = []
_lock = threading.Lock()


def _thread(group: str, link: Link) -> _PeerThread:
    with _lock:
        key = (group, link.peer, threading.get_ident())
        t = _threads.get(key)
        if t is None:
            t = _threads[key] = _PeerThread(link)
            _made.append(t)
        return t


def _drain(link: Link, works: list[tuple[Any, torch.Tensor]]) -> None:
    """Wait out the receives a failed pass left posted, on a thread of their own.

    Each will complete (a peer's poison, or gloo's error for a lost peer), and a receive
    must not be freed while it is posted: a thread waits for each, then drops it. One
    that never completes (a frozen peer) is freed at exit (:func:`_release_at_exit`).
    """
    t = _PeerThread(link, drain=True)
    with _lock:
        _made.append(t)
    t.jobs.put((link.peer, works, queue.SimpleQueue()))
    t.jobs.put(None)


def _retire(group: str, peer: int) -> None:
    """Stop reusing ``peer``'s thread: it may still wait on a receive that never completes."""
    with _lock:
        t = _threads.pop((group, peer, threading.get_ident()), None)
    if t is not None:
        t.jobs.put(None)


@atexit.register
def _release_at_exit() -> None:
    """Free threads still blocked on a receive (from a rank that froze) before the process exits.

    A thread inside gloo's ``wait()`` when the interpreter finalizes aborts the process, and
    nothing but the peer or gloo itself ends such a wait: a receive that times out closes the
    group's connections, which ends every wait on the group with an error. Only a group
    that still has such a wait is closed, at exit, when nothing else will use it.
    """
    with _lock:
        made = list(_made)
    severed: set[int] = set()
    for t in made:
        if t.waiting and id(t.pg) not in severed:
            severed.add(id(t.pg))
            sever(t.pg, t.group_peer)
    for t in made:
        t.jobs.put(None)
    for t in made:
        t.thread.join(0.5)
