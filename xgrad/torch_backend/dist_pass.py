"""One rank's side of a distributed backward pass, as xgrad's engine sees a context.

``xgrad.engine.Engine.backward_distributed`` drives a pass through a small context
protocol (``sends_of``, ``recvs_of``, ``deliver``, ``receive``, ``raise_if_failed``,
``fail``, ``finish``, ``release``); the in-process ``DistContext`` implements it with
threads, :class:`ProcessPass` with c10d messages between processes and the failure
channel: every wait is bounded and any rank's failure is raised here too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from xgrad.engine import DistBackwardError as _EngineDistBackwardError
from xgrad.failure import (
    FailureChannel,
    RankError,
    RankUnresponsiveError,
    default_seconds,
    error_for,
)
from xgrad.torch_backend.dist_bytes import DONE, GRAD, NO_GRAD, POISON, header
from xgrad.torch_backend.dist_edges import recv_hooks
from xgrad.torch_backend.dist_inbox import Inbox, Message
from xgrad.torch_backend.dist_watch import What, text
from xgrad.torch_backend.dist_wire import payload
from xgrad.torch_backend.failure import poisoned, transfer_failed, wait_posted
from xgrad.torch_backend.lost_rank import CLOSED_BEFORE, silent_peer

#: gloo's words for a transfer on a pair whose peer went away.
_GLOO_LOST = ("Connection closed", "Connection reset", "Read error", "caused pair closure")

#: seconds the heartbeats are read for, after such a failure, for the peer that stopped.
_LOST_WITHIN = 2.5

__all__ = [
    "DistBackwardError",
    "DistBackwardUnresponsiveError",
    "ProcessPass",
    "end",
]


class DistBackwardError(_EngineDistBackwardError, RankError):  # type: ignore[misc]
    """Raised on every rank of a context when any rank failed.

    The message names the origin first: ``"Error on rank 1 in MulBackward0: ValueError: ..."``.
    Attributes: ``rank`` (origin), ``raised_on`` (this rank), ``context_id``, ``failure``
    (:class:`xgrad.failure.Failure`), and the engine's ``node_name``/``message``/``worker``.
    """

    def __init__(self, context_id: int, error: RankError) -> None:
        f = error.failure
        self.failure, self.rank, self.prefix = f, f.rank, ""
        self.raised_on = -1 if error.raised_on is None else error.raised_on
        self.context_id, self.node, self.node_name = context_id, -1, f.where
        self.message, self.worker = f.message, f.rank
        RuntimeError.__init__(self, "Error on " + f.text())

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (self.context_id, RankError(self.failure, self.raised_on))


class DistBackwardUnresponsiveError(DistBackwardError, RankUnresponsiveError):  # type: ignore[misc]
    """A rank of the context stopped answering (died, froze) or a wait timed out."""


class ProcessPass:
    """The engine's context for one backward pass of one rank.

    Args:
        context_id: the user-facing context id.
        ranks: the group's ranks (global).
        me: this rank (global).
        inbox: the pass's messages (:class:`Inbox`: receives already posted).
        sends: ``(peer, k, tensor, node)`` of this rank's sends that require grad.
        recvs: recv node -> ``(peer, k, tensor, its RecvBackward node)``.
        channel: the context's failure channel.
        make_error: turns a :class:`RankError` into the error the user sees.
        unreached: ``(peer, k)`` of received tensors that require grad but that no root
            or send of this rank leads to.
        leader: the rank that collects every other rank's "done" and then tells each
            that all are done (None: every rank tells every other).
        keep: where the pass's sends go once it finished, to be waited for later (at the
            context's exit); None: :meth:`finish` waits for them.
    """

    def __init__(
        self,
        context_id: int,
        ranks: Sequence[int],
        me: int,
        inbox: Inbox,
        sends: Sequence[tuple[int, int, torch.Tensor, int]],
        recvs: dict[int, tuple[int, int, torch.Tensor, Any]],
        channel: FailureChannel,
        make_error: Callable[[RankError], Exception],
        unreached: Sequence[tuple[int, int]] = (),
        *,
        leader: int | None = None,
        keep: list[Any] | None = None,
    ) -> None:
        self._leader = leader
        self._keep = keep
        self.context_id = context_id
        self.workers = tuple(ranks)
        self.me = me
        self._inbox = inbox
        self._sent: dict[int, dict[int, torch.Tensor]] = {}
        self._node: dict[tuple[int, int], int] = {}
        for p, k, t, node in sends:
            self._sent.setdefault(p, {})[k] = t
            self._node[(p, k)] = node
        self._recvs = recvs
        # The received tensors not answered yet: their reply buffers are made when this
        # rank first waits (what was answered by then needs none; :mod:`.dist_slots`).
        self._owed = {node: (p, t) for node, (p, _, t, _) in recvs.items()}
        inbox.ahead(self._sent, self._owed)
        self._channel = channel
        self._make_error = make_error
        self._poll = default_seconds("poll_interval")
        # The channel was read when the context began and is read by every wait; between
        # nodes it is read once per poll interval, not at the start of each pass (a store
        # round trip and the peers' heartbeats, on the pass's critical path).
        self._next_poll = time.monotonic() + self._poll
        self.failed = False
        # Received tensors the graph does not reach: their senders learn at once that
        # no gradient comes.
        with self._named():
            for peer, k in unreached:
                self._send(peer, NO_GRAD, k, None, None)

    @contextlib.contextmanager
    def _named(self) -> Iterator[None]:
        try:
            yield
        except RankError as exc:
            self.failed = True
            raise self._make_error(exc) from None

    def _send(
        self, peer: int, kind: int, k: int, grad: torch.Tensor | None, like: torch.Tensor | None
    ) -> None:
        try:
            self._inbox.send(peer, kind, k, grad, like)
        except RuntimeError as exc:  # gloo: the connection to a dead peer is closed
            what = f"backward, message to rank {peer}"
            raise transfer_failed(self._channel, what, exc, peer) from exc

    def _next(self, what: What, item: Message | None = None) -> tuple[int, int, int, torch.Tensor]:
        """The next message from any peer: ``(peer, kind, k, buffer)``; raises a poison's failure."""
        peer, _, buf, error = self._inbox.next(what) if item is None else item
        if error is not None:
            raise transfer_failed(self._channel, f"{text(what)}, from rank {peer}", error, peer)
        made = self._inbox.views.header(buf)
        kind, k = header(buf) if made is None else made
        if kind == POISON:
            raise poisoned(self._channel, peer, "backward", self._inbox.timeout)
        return peer, kind, k, buf

    def sends_of(self, worker: int) -> tuple[int, ...]:
        return tuple(self._node.values())

    def recvs_of(self, worker: int) -> dict[int, tuple[int, int]]:
        return {node: (p, k) for node, (p, k, _, _) in self._recvs.items()}

    def deliver(self, worker: int, recv_node: int, grad: Any, *, hooked: bool = False) -> None:
        """Send the gradient of a received tensor back to its sender (None: no gradient).

        The hooks on the received tensor's node (``register_hook``, ``retain_grad``) see
        its summed gradient, and what they return is what goes back, as PyTorch's engine
        runs them before its ``RecvRpcBackward`` (:func:`.dist_edges.recv_hooks`);
        ``hooked``: they already ran (torch's engine captured the gradient there).
        """
        peer, k, like, node = self._recvs[recv_node]
        self._owed.pop(recv_node, None)
        if grad is not None and not hooked:
            grad = recv_hooks(like, node, grad)
        with self._named():
            if grad is None:
                self._send(peer, NO_GRAD, k, None, None)
            else:
                self._send(peer, GRAD, k, grad, like)

    def receive(self, worker: int) -> tuple[int, Any]:
        """The next ``(send node, gradient)`` from any peer (bounded, watching the channel)."""
        with self._named():
            while True:
                peer, kind, k, buf = self._next(self._gradients_from)
                if kind == DONE:  # a peer that finished early: counted by the inbox
                    continue
                return self._gradient(peer, kind, k, buf)

    def _gradients_from(self) -> str:
        return f"backward, gradients from ranks {self._inbox.waiting_for()}"

    def receive_landed(self, worker: int) -> list[tuple[int, Any]]:
        """Every ``(send node, gradient)`` that already landed (never waits)."""
        out = []
        with self._named():
            while (item := self._inbox.ready()) is not None:
                peer, kind, k, buf = self._next("backward", item)
                if kind != DONE:
                    out.append(self._gradient(peer, kind, k, buf))
        return out

    def _gradient(self, peer: int, kind: int, k: int, buf: torch.Tensor) -> tuple[int, Any]:
        like = self._sent.get(peer, {}).get(k)
        if like is None:
            raise RuntimeError(f"rank {peer} sent a gradient for send {k}, which was not made")
        if kind == NO_GRAD:
            return self._node[(peer, k)], None
        grad = self._inbox.views.payload(buf, k)
        if grad is None:
            grad = payload(buf, like)
        if grad.device != like.device:
            grad = grad.to(like.device)
        return self._node[(peer, k)], grad

    def raise_if_failed(self, worker: int) -> None:
        """Raise another rank's failure; reads the channel at most every poll interval."""
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + self._poll
            with self._named():
                self._channel.check()

    def fail(self, worker: int, node: int, node_name: str, message: str) -> Exception:
        """Post this rank's failure (the first one posted wins) and return the error to raise."""
        self.failed = True
        if not node_name and any(words in message for words in _GLOO_LOST):
            # Gloo, posting or waiting on a transfer: a peer that died closed the
            # connection, so the rank to name is the one whose heartbeat stopped (a killed
            # one is seen stale within about a second), not this one.
            silent = silent_peer(self._channel, within=_LOST_WITHIN)
            if silent is not None and silent != self.me:
                failure = self._channel.post(
                    "",
                    f"stopped answering while rank {self.me} waited in backward: {message}",
                    kind="unresponsive",
                    rank=silent,
                )
                return self._make_error(error_for(failure, self.me))
            if "Connection closed" in message:  # every rank beats: the group was lost before
                message += f" ({CLOSED_BEFORE})"
        failure = self._channel.post(node_name, message)
        return self._make_error(RankError(failure, self.me))

    def finish(self, worker: int) -> None:
        """Tell the other ranks this one finished, wait until they all did.

        With a leader, the others tell the leader, and the leader, once it heard from
        all, tells each of them (a rank failing meanwhile poisons its "done", so the
        leader poisons every rank's); otherwise every rank tells every other. Then every
        send arrived but the leader's last ones, which are kept (``keep``) or waited for.
        """
        leader = self._leader
        with self._named():
            for peer in self.workers:
                if peer != self.me and leader in (None, peer):
                    self._send(peer, DONE, 0, None, None)
            while not self._inbox.done_from_all():
                peer, kind, _, _ = self._next(self._to_finish)
                if kind != DONE:
                    raise RuntimeError(f"rank {peer} sent a gradient (kind {kind}) after the pass")
            if leader == self.me:
                for peer in self.workers:
                    if peer != self.me:
                        self._send(peer, DONE, 0, None, None)
            if self._keep is not None:
                self._keep.extend(self._inbox.sent)
            else:
                for peer, (work, _) in self._inbox.sent:
                    what = f"backward, message to rank {peer}"
                    wait_posted(
                        work, self._channel, timeout=self._inbox.timeout, what=what, peer=peer
                    )
            self._inbox.sent.clear()

    def _to_finish(self) -> str:
        return f"backward, waiting for ranks {self._inbox.waiting_for()} to finish"

    def release(self, worker: int) -> None:
        """After a failure: answer what this rank still owes with poison; keep the rest referenced."""
        end(self._inbox, self.failed)


def end(inbox: Inbox, failed: bool) -> None:
    """Close a pass's inbox; after a failure, poison what is owed first."""
    if failed:
        inbox.poison()
    inbox.close(failed)
