"""The backward messages one rank expects in a pass: receives posted up front, first in first out.

At the start of a pass a rank knows everything it will receive: from each peer ``q`` one
gradient message per tensor it sent ``q`` that requires grad (its shape is the sent
tensor's), then ``q``'s "done". So every receive is posted before the peer sends, and
gloo writes the peer's message the moment it is sent (no ready round trip, no header in
the store).

The rank waits for them on its own thread (``WAIT = "caller"``, :mod:`.dist_watch`)
when its gradients come from at most one peer (a chain, a leaf rank: the common case),
or when, by its first wait, it owes no peer anything more (a rank that sent tensors to
several peers and answered every tensor it received, such as a fan-out's first rank):
on each peer's receives in order, then on the "done"s, each wait bounded by the
context's timeout and watched for a peer that stopped; no thread hand-off, which costs a
second wake-up per message. When gradients may come from several peers first and this
rank still owes some (a gradient from one may be what lets this rank answer another),
or with ``WAIT = "threads"``, one daemon thread per peer waits that peer's receives in
order and hands each completion to one queue; the caller takes whichever lands first, sleeping in the
queue and reading the failure channel every poll interval. (Gloo's receives from any
peer would do it on one thread, but a dead peer does not fail them: only their timeout
would end them.)

Posting the receives, in one mode or the other (:meth:`Inbox.arm`), is
:mod:`.dist_inbox_post`.
"""

from __future__ import annotations

import os
import queue
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from xgrad.failure import FailureChannel, check_seconds, default_seconds
from xgrad.heartbeat import waiting_for
from xgrad.torch_backend.dist_bytes import DONE, POISON
from xgrad.torch_backend.dist_graveyard import bury, bury_sent
from xgrad.torch_backend.dist_inbox_post import ReceivePosting
from xgrad.torch_backend.dist_slots import ReceiveViews
from xgrad.torch_backend.dist_threads import Message, _drain, _made, _retire
from xgrad.torch_backend.dist_watch import What, text, wait_here
from xgrad.torch_backend.dist_wire import Link

__all__ = ["WAIT", "Inbox", "Message", "_made"]

#: where a pass waits for its messages: "caller" (its own thread) or "threads" (one per peer).
WAIT = os.environ.get("XGRAD_DIST_WAIT", "caller")


class Inbox(ReceivePosting):
    """The receives of one rank's pass, posted together; :meth:`next` returns the first to land.

    Args:
        group: the process group's name (the waiting threads are kept per group and peer).
        links: peer -> :class:`Link`, for every other rank of the group.
        expect: peer -> byte sizes of the gradient messages expected from it (one per
            tensor sent to it that requires grad, in the order sent); the peers in the
            order their gradients are waited for when waited on this thread.
        owe: peer -> byte sizes of the gradient messages this rank will send it (one per
            tensor received from it that requires grad).
        channel: the context's failure channel.
        timeout: seconds a single :meth:`next` may wait.
        dones: the peers this rank exchanges "done" with (default: every peer).
    """

    def __init__(
        self,
        group: str,
        links: dict[int, Link],
        expect: Mapping[int, Sequence[int]],
        owe: Mapping[int, Sequence[int]],
        channel: FailureChannel,
        timeout: float,
        *,
        dones: Collection[int] | None = None,
    ) -> None:
        self._group = group
        self._links = links
        self._channel = channel
        self.timeout = check_seconds("timeout", timeout)
        self._poll = default_seconds("poll_interval")
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._done_peers = set(links if dones is None else dones)
        self._expected = {p: len(expect.get(p, ())) + (p in self._done_peers) for p in links}
        self._got = dict.fromkeys(links, 0)
        self._owe = {p: len(owe.get(p, ())) for p in links}  # gradients
        self._owe_done = {p: int(p in self._done_peers) for p in links}
        self.sent: list[tuple[int, Any]] = []
        self.buffers: list[tuple[Any, torch.Tensor]] = []  # the receives: (work, buffer)
        #: the posted gradients' header and payload views (:mod:`.dist_slots`)
        self.views = ReceiveViews()
        self._sent_tensors: Mapping[int, Mapping[int, torch.Tensor]] = {}
        self._owed_tensors: Mapping[Any, tuple[int, torch.Tensor]] = {}
        self._expect = expect
        self._armed = False
        senders = [p for p in links if expect.get(p)]
        # On NCCL ``wait()`` does not block the caller (it orders the current stream), so
        # only a thread of its own can bound the wait: the per-peer threads do.
        self._here_ok = WAIT == "caller" and all(
            link.device.type == "cpu" for link in links.values()
        )
        #: "one" (waited here: gradients from at most one peer, or nothing owed any more
        #: when the first wait comes, see :meth:`arm`) or "threads"
        self.mode = "one" if self._here_ok and len(senders) <= 1 else "threads"
        # Receives waited on this thread: the gradients, then the dones.
        self._here: deque[tuple[int, Any, torch.Tensor]] = deque()
        self._dones: deque[tuple[int, Any, torch.Tensor]] = deque()
        for peer, link in links.items():
            link.start_backward(owe.get(peer, ()))

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

    def next(self, what: What) -> Message:
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

    def _wait_here(self, what: What) -> Message:
        fifo = self._here or self._dones
        peer, work, buf = fifo[0]
        link = self._links[peer]
        wait_here(work, self._channel, link.pg, link.group_peer, self.timeout, what, peer)
        fifo.popleft()
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

    def _wait(self, what: What) -> Message:
        start = time.monotonic()
        deadline = start + self.timeout
        pending = self.waiting_for()
        # Published with the heartbeat: a rank that times out waiting for this one follows
        # it to the rank it waits for (one of them; the first still owing).
        before = waiting_for(pending[0] if pending else None)
        try:
            while True:
                now = time.monotonic()
                try:
                    return self._queue.get(timeout=max(0.0, min(self._poll, deadline - now)))
                except queue.Empty:
                    pass
                self._channel.check()
                if time.monotonic() >= deadline:
                    raise self._channel.timed_out(
                        text(what), self.timeout, peers=self.waiting_for()
                    )
        finally:
            waiting_for(before)

    def waiting_for(self) -> list[int]:
        """The peers some message of this pass is still expected from."""
        return [p for p, n in self._expected.items() if self._got[p] < n]

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
        bury_sent(self.sent)
        self.sent = []
        if failed:
            for work, buf in self.buffers:
                bury(work, buf)
            left: dict[int, list[tuple[Any, torch.Tensor]]] = {}
            for peer, work, buf in (*self._here, *self._dones):
                left.setdefault(peer, []).append((work, buf))
            self._here, self._dones = deque(), deque()
            for peer, works in left.items():
                _drain(self._links[peer], works)
            if self._armed and self.mode == "threads":
                for peer in self.waiting_for():
                    _retire(self._group, peer)

    def done_from_all(self) -> bool:
        return not self.waiting_for()
