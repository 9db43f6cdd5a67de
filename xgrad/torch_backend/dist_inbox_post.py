"""Posting the receives of one rank's pass: where it will wait, and the receives posted there.

:meth:`ReceivePosting.arm` posts, once and before the pass's first wait, every message
the rank expects (each peer's gradients, then its "done"): on this thread when gradients
come from at most one peer or nothing is owed any more, otherwise handed to one waiting
thread per peer (:mod:`.dist_threads`); either way the gradients' buffers are made ahead
(:mod:`.dist_slots`) from the tensors :meth:`~ReceivePosting.ahead` named. Kept apart
from :mod:`.dist_inbox` (whose :class:`~xgrad.torch_backend.dist_inbox.Inbox` mixes this
in), which sets the pass up, takes the messages as they land and ends the pass.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from xgrad.failure import FailureChannel, error_for
from xgrad.torch_backend.dist_slots import ReceiveViews, make_ahead
from xgrad.torch_backend.dist_threads import Message, _thread
from xgrad.torch_backend.dist_wire import Link

__all__ = ["ReceivePosting"]


class ReceivePosting:
    """Mixed into :class:`~xgrad.torch_backend.dist_inbox.Inbox`; uses its state (declared
    below, set by its constructor)."""

    mode: str
    buffers: list[tuple[Any, torch.Tensor]]
    views: ReceiveViews
    _group: str
    _links: dict[int, Link]
    _channel: FailureChannel
    _queue: queue.SimpleQueue[Message]
    _done_peers: set[int]
    _owe: dict[int, int]
    _expect: Mapping[int, Sequence[int]]
    _sent_tensors: Mapping[int, Mapping[int, torch.Tensor]]
    _owed_tensors: Mapping[Any, tuple[int, torch.Tensor]]
    _armed: bool
    _here_ok: bool
    _here: deque[tuple[int, Any, torch.Tensor]]
    _dones: deque[tuple[int, Any, torch.Tensor]]

    def ahead(
        self,
        sent: Mapping[int, Mapping[int, torch.Tensor]],
        owed: Mapping[Any, tuple[int, torch.Tensor]],
    ) -> None:
        """What to make buffers for when this rank first waits (:mod:`.dist_slots`): ``sent``,
        peer -> {k: the k-th grad-requiring tensor sent it}; ``owed``, the received tensors
        whose gradient is still to be sent, as ``(peer, tensor)`` (the pass's own mapping,
        read then: what was answered before is left out)."""
        self._sent_tensors = sent
        self._owed_tensors = owed

    def arm(self) -> None:
        """Post the pass's receives (once; before the first wait).

        Not at the start of the pass: posting costs a message to each peer, and the first
        gradients this rank sends should not wait for that. A message that comes before its
        receive is posted waits in gloo, and is matched when the receive is posted.
        """
        if self._armed:
            return
        self._armed = True
        if self._here_ok and not any(self._owe.values()):
            # Nothing this rank still owes a peer can depend on which gradient lands
            # first: every peer's remaining messages come without this rank's help, so
            # waiting for them peer by peer on this thread cannot deadlock (a failing
            # peer's poison or the watchdog still ends each wait), and no thread
            # hand-off costs a second wake-up per message.
            self.mode = "one"
        if self.mode == "one":
            self._check_before_waiting_here()
        if self.mode == "threads":
            posted: dict[int, list[torch.Tensor]] = {}
            for peer, link in self._links.items():
                works = link.post_gradients(self._expect.get(peer, ()))
                posted[peer] = [b for _, b in works]
                if peer in self._done_peers:
                    works.append(link.post_done())
                self.buffers += works
                _thread(self._group, link).jobs.put((peer, works, self._queue))
            # made before this thread reads a message (the threads only wait)
            make_ahead(self.views, self._links, posted, self._sent_tensors, self._owed_tensors)
            return
        # Gradients from several peers are waited for peer by peer in the order of
        # ``expect``: the peer sent a tensor last first, as its gradient is likely to come
        # back first (a backward pass runs the graph in reverse); a wait on a peer whose
        # message comes later only delays processing one that already landed.
        here: dict[int, list[torch.Tensor]] = {}
        for peer in (*self._expect, *(p for p in self._links if p not in self._expect)):
            works = self._links[peer].post_gradients(self._expect.get(peer, ()))
            self._here.extend((peer, w, b) for w, b in works)
            here[peer] = [b for _, b in works]
        make_ahead(self.views, self._links, here, self._sent_tensors, self._owed_tensors)
        for peer, link in self._links.items():
            if peer in self._done_peers:
                self._dones.append((peer, *link.post_done()))
        self.buffers += [(w, b) for _, w, b in (*self._here, *self._dones)]

    def _check_before_waiting_here(self) -> None:
        """Raise a failure already posted, once, before the pass's first wait on this thread.

        A peer that failed outside a pass answers every tensor this rank sent it with a
        poison gradient, finding them by their headers in the store. A tensor sent after
        that read goes unanswered, and a wait on this thread ends only by a message or the
        timeout (the watchdog leaves a live rank's failure to its poison). This read comes
        after every send of the context: a failure it misses was posted after it, hence
        after this rank's headers were written, and the failing rank read the headers
        after posting, so it found them and answers. One store lookup per pass, made
        while this rank would wait anyway; the threads' waits read the channel as they go.
        """
        failure = self._channel.poll()
        if failure is not None:
            raise error_for(failure, self._channel.rank)
