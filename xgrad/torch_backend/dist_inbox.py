"""The backward messages one rank expects in a pass: receives posted up front, first in first out.

At the start of a pass a rank knows everything it will receive: from each peer ``q`` one
gradient message per tensor it sent ``q`` that requires grad (its shape is the sent
tensor's), then ``q``'s "done". So every receive is posted before the peer sends, and
gloo writes the peer's message the moment it is sent (no ready round trip, no header in
the store).

The rank waits for them on its own thread (``WAIT = "caller"``, :mod:`.dist_watch`):
when its gradients come from one peer, on that peer's receives in order; from several
peers (gloo), on receives from any peer, which complete in the order the messages land
(a gradient from one peer may be what lets this rank answer another); the "done"s, peer
by peer. Each wait is bounded by the context's timeout and watched for a peer that
stopped. Where receives from any peer do not exist (NCCL), or with ``WAIT = "threads"``,
one daemon thread per peer waits that peer's receives in order and hands each
completion to one queue, which the caller reads, watching the failure channel every
poll interval. The caller's thread saves the hand-off, a second wake-up per message.

A rank whose pass fails while it is alive answers every message it still owes with a
"poison" header (:meth:`Inbox.poison`): its peers' receives all complete, they read the
failure channel and raise the origin's error, and nothing is left posted on the group.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from xgrad.failure import FailureChannel, RankError, check_seconds, default_seconds
from xgrad.torch_backend.dist_watch import sever, wait_here
from xgrad.torch_backend.dist_wire import DONE, POISON, Link, post_any

__all__ = ["GRAVEYARD", "WAIT", "Inbox", "Message"]

#: where a pass waits for its messages: "caller" (its own thread) or "threads" (one per peer).
WAIT = os.environ.get("XGRAD_DIST_WAIT", "caller")

#: sends and receives that may still be in flight when their pass or context ended (a
#: failure, or sends nobody waited for): kept referenced with their buffers, because gloo
#: drops a send whose buffer is freed and writes a receive into its buffer when it lands.
GRAVEYARD: list[Any] = []

#: (peer, index of the message from that peer, buffer, the wait's error or None)
Message = tuple[int, int, torch.Tensor, BaseException | None]


class _PeerThread:
    """A daemon thread that waits one peer's posted receives, in order, for pass after pass."""

    def __init__(self, link: Link) -> None:
        self.pg = link.pg
        self.group_peer = link.group_peer
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
                self.waiting = True
                try:
                    self._wait(work, buf)
                except BaseException as exc:  # gloo: the peer died; the rest cannot come
                    out.put((peer, i, buf, exc))
                    break
                finally:
                    self.waiting = False
                out.put((peer, i, buf, None))

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


class Inbox:
    """The receives of one rank's pass, posted together; :meth:`next` returns the first to land.

    Args:
        group: the process group's name (the waiting threads are kept per group and peer).
        links: peer -> :class:`Link`, for every other rank of the group.
        expect: peer -> byte sizes of the gradient messages expected from it (one per
            tensor sent to it that requires grad, in the order sent).
        owe: peer -> byte sizes of the gradient messages this rank will send it (one per
            tensor received from it that requires grad).
        channel: the context's failure channel.
        timeout: seconds a single :meth:`next` may wait.
    """

    def __init__(
        self,
        group: str,
        links: dict[int, Link],
        expect: Mapping[int, Sequence[int]],
        owe: Mapping[int, Sequence[int]],
        channel: FailureChannel,
        timeout: float,
    ) -> None:
        self._group = group
        self._links = links
        self._channel = channel
        self.timeout = check_seconds("timeout", timeout)
        self._poll = default_seconds("poll_interval")
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._expected = {p: len(expect.get(p, ())) + 1 for p in links}
        self._got = dict.fromkeys(links, 0)
        self._owe = {p: len(owe.get(p, ())) for p in links}  # gradients
        self._owe_done = dict.fromkeys(links, 1)
        self.sent: list[tuple[int, Any]] = []
        self.buffers: list[torch.Tensor] = []
        self._expect = expect
        self._armed = False
        senders = [p for p in links if expect.get(p)]
        cpu = all(link.device.type == "cpu" for link in links.values())
        #: "one" (gradients from at most one peer), "any" (from several, gloo), "threads"
        self.mode = "threads" if WAIT == "threads" else "one" if len(senders) <= 1 else "any"
        if self.mode == "any" and not cpu:
            self.mode = "threads"
        # Receives waited on this thread: gradients (peer None: from any), then the dones.
        self._here: deque[tuple[int | None, Any, torch.Tensor]] = deque()
        self._dones: deque[tuple[int | None, Any, torch.Tensor]] = deque()
        self._peer_of = {link.group_peer: p for p, link in links.items()}
        for peer, link in links.items():
            link.start_backward(owe.get(peer, ()))

    def arm(self) -> None:
        """Post the pass's receives (once; before the first wait).

        Not at the start of the pass: posting costs a message to each peer, and the first
        gradients this rank sends should not wait for that. A message that comes before its
        receive is posted waits in gloo, and is matched when the receive is posted.
        """
        if self._armed:
            return
        self._armed = True
        if self.mode == "threads":
            for peer, link in self._links.items():
                works = link.post_backward(self._expect.get(peer, ()))
                self.buffers += [buf for _, buf in works]
                _thread(self._group, link).jobs.put((peer, works, self._queue))
            return
        if self.mode == "any":
            sizes = [n for p in self._links for n in self._expect.get(p, ())]
            link = next(iter(self._links.values()))
            self._here.extend(
                (None, w, b) for w, b in post_any(link.pg, link.seq, sizes, link.device)
            )
        for peer, link in self._links.items():
            if self.mode == "one":
                works = link.post_gradients(self._expect.get(peer, ()))
                self._here.extend((peer, w, b) for w, b in works)
            self._dones.append((peer, *link.post_done()))
        self.buffers += [b for _, _, b in (*self._here, *self._dones)]

    def send(
        self,
        peer: int,
        kind: int,
        k: int = 0,
        grad: torch.Tensor | None = None,
        like: torch.Tensor | None = None,
    ) -> None:
        """Send message ``kind`` to ``peer`` (see :meth:`Link.send_backward`)."""
        work = self._links[peer].send_backward(kind, k, grad, like)
        if kind == DONE:
            self._owe_done[peer] = 0
        else:
            self._owe[peer] -= 1
        self.sent.append((peer, work))

    def next(self, what: str) -> Message:
        """The next message: a gradient while any is expected (from whichever peer sends
        first), then the peers' "done"s; bounded by the timeout, watching for failures.

        Raises:
            RankError: a failure posted on the channel, a peer that stopped beating, or the
                timeout (posted first, so every rank stops).
        """
        self.arm()
        if self.mode != "threads":
            return self._wait_here(what)
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            item = self._wait(what)
        self._got[item[0]] += 1
        return item

    def _wait_here(self, what: str) -> Message:
        fifo = self._here or self._dones
        peer, work, buf = fifo[0]
        link = self._links[peer] if peer is not None else next(iter(self._links.values()))
        wait_here(work, self._channel, link.pg, link.group_peer, self.timeout, what, peer)
        fifo.popleft()
        if peer is None:
            peer = self._peer_of[work._source_rank()]
        i = self._got[peer]
        self._got[peer] = i + 1
        return peer, i, buf, None

    def ready(self) -> Message | None:
        """The next message that already landed, or None (never waits; on this thread, a
        receive is not known to have landed before it is waited for: always None)."""
        self.arm()
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return None
        self._got[item[0]] += 1
        return item

    def _wait(self, what: str) -> Message:
        start = time.monotonic()
        deadline = start + self.timeout
        while True:
            now = time.monotonic()
            try:
                return self._queue.get(timeout=max(0.0, min(self._poll, deadline - now)))
            except queue.Empty:
                pass
            self._channel.check()
            if time.monotonic() >= deadline:
                raise self._channel.timed_out(what, self.timeout)

    def waiting_for(self) -> list[int]:
        """The peers some message of this pass is still expected from."""
        return [p for p, n in self._expected.items() if self._got[p] < n]

    def poisoned(self, peer: int) -> RankError:
        """The failure behind a poison header from ``peer`` (posted before the poison was sent)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            self._channel.check()
            time.sleep(0.001)
        failure = self._channel.post(
            "backward", f"rank {peer} sent a poison header, but no failure was posted"
        )
        return RankError(failure, self._channel.rank)

    def poison(self) -> None:
        """Answer every message still owed with a poison header, so no peer waits for it."""
        for peer, link in self._links.items():
            try:
                for _ in range(self._owe[peer]):
                    self.sent.append((peer, link.send_backward(POISON, 0, None)))
                if self._owe_done[peer]:
                    self.sent.append((peer, link.send_backward(POISON, 0, None, final=True)))
            except RuntimeError:  # gloo: that peer's connection is gone; nothing waits
                pass
            self._owe[peer] = self._owe_done[peer] = 0

    def close(self, failed: bool) -> None:
        """After the pass: keep what may still be in flight; after a failure, stop reusing
        the threads of peers whose receives may still be posted.

        Sends nobody waited for (:attr:`sent` is cleared once they were) stay referenced,
        and so do the receives' buffers after a failure.
        """
        if self.sent:
            GRAVEYARD.append(self.sent)
            self.sent = []
        if failed:
            GRAVEYARD.append(self.buffers)
            if self._here or self._dones:
                GRAVEYARD.append([*self._here, *self._dones])
                self._here, self._dones = deque(), deque()
            if self._armed and self.mode == "threads":
                for peer in self.waiting_for():
                    _retire(self._group, peer)

    def done_from_all(self) -> bool:
        return not self.waiting_for()
