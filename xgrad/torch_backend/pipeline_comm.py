"""The messages of one pipeline step: receives posted ahead, bounded waits on this thread.

Gloo moves a message only once its receive is posted (the receiver tells the sender it is
ready), so a receive posted when its data is needed costs a round trip through a peer that
is busy computing. The runtime knows every message of its step in advance (the schedule's
receives, in order), and after the first step its shapes too, so :class:`StepWire` posts
each receive a few actions before it is needed, as torch's own runtime does.

An edge's receives are posted in the order its sender sends (validation checks it), and
each pass takes the message of its microbatch, which need not be the next in line: ranks
may order an edge's microbatches differently, as in torch's runtime (a forward first takes
the messages sent before its own, whose side-tag payloads come first).

Every message on an edge (source stage, consumer stage) and direction starts with a header
of two int64, ``(code, microbatch)``, on that edge's main tag, packed with the leaves in
one buffer when they are small (:mod:`~xgrad.torch_backend.pipeline_frame`):

* ``code == 0``: the leaves follow, laid out as both ends expect: the description the
  edge carried for that microbatch in the step before (forward; per microbatch, so that
  uneven microbatches, 3, 3, 2, 2 rows, each find theirs), or the gradients of the leaves
  that carried one (backward). The receiver posted those buffers ahead.
* ``code > 0`` (forward only): the description changed (or none is known yet, the first
  step). The header comes alone (with dummies for leaf buffers posted apart from it); the
  description (``code`` bytes of JSON) and the leaves follow on the edge's side tag.
* ``code > 0`` (backward): bit i marks leaf i as having no gradient (None: the sender's
  stage ignored that input); its bytes still travel (the buffers were posted ahead), the
  receiver reads None there (:func:`~xgrad.torch_backend.pipeline_frame.none_code`).
* ``code == POISON``: the sender failed while alive; the failure is in the channel.

Waits run on the caller's thread, bounded by the runtime's timeout (no thread hand-off).
A rank that fails while alive posts its failure, then poisons every edge on which a peer
still expects a message from it: a peer blocked on a header wakes, reads the channel and
raises the origin's error, then poisons its own edges in turn. A killed peer fails a wait
at once (gloo closes the connection); a frozen one fails it after the timeout, named from
the heartbeats. A failed step leaves receives posted that gloo cannot cancel, so the runtime
moves the next step to a fresh private group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, cast

import torch

from xgrad.failure import FailureChannel
from xgrad.heartbeat import waiting_for
from xgrad.pipeline import Action, Kind, Schedule
from xgrad.torch_backend.failure import poisoned, transfer_failed
from xgrad.torch_backend.pipeline_edges import POISON, Incoming
from xgrad.torch_backend.pipeline_frame import frame_of, with_nones
from xgrad.torch_backend.pipeline_route import WirePlan
from xgrad.torch_backend.pipeline_sends import Shapes, StepSends
from xgrad.torch_backend.pipeline_wire import (
    Description,
    EdgeCache,
    empty_leaves,
    layout,
    mark_gradients,
    rebuild,
)

__all__ = ["POISON", "StepWire"]


_Grads = list[torch.Tensor | None]


class StepWire(StepSends):
    """The sends and receives of one rank in one step (made fresh for every step).

    Args:
        plan: what the step needs of the schedule (the same every step).
        schedule: the validated schedule (with comms); ``rank`` this rank.
        groups: the private groups (lanes, see ``pipeline_lanes``) of the step's
            transfers; ``ranks[r]`` is schedule rank r's rank in them.
        tag: this step's tag base; ``edges`` the descriptions carried last per edge and
            microbatch (from the steps before: what receives are posted for).
        channel: the step's failure channel; ``timeout`` bounds every wait.
        device: ``device(stage)``, where a stage's received tensors go.
        grad_shapes: ``grad_shapes(stage, mb)``, the shapes of the gradients that come back
            for an output this rank computed, or None before its forward ran.
        window: receives are posted for the next ``window`` actions of the rank.
    """

    def __init__(
        self,
        plan: WirePlan,
        schedule: Schedule,
        rank: int,
        groups: Sequence[Any],
        ranks: Sequence[int],
        tag: int,
        edges: EdgeCache,
        channel: FailureChannel,
        timeout: float,
        device: Callable[[int], torch.device],
        grad_shapes: Callable[[int, int], Shapes | None],
        window: int,
    ) -> None:
        super().__init__(plan, schedule, rank, groups, ranks, tag, channel, timeout, device)
        self._edges, self._grad_shapes, self._window = edges, grad_shapes, window
        self._recvs = plan.recvs
        self._next = 0  # next receive action to post
        self._posted_actions: set[Action] = set()
        # Forward inputs taken ahead of their pass, per (edge, microbatch): see
        # receive_forward.
        self._early: dict[tuple[tuple[int, int, int], int], Any] = {}
        self.waited = 0.0  # seconds spent blocked in receives (for the action records)

    # -- posting ahead -----------------------------------------------------------------

    def advance(self, index: int) -> None:
        """Post, in schedule order, the receives of the actions before ``index + window``
        (a gradient's receive once its forward ran: its shapes are known then)."""
        limit = index + self._window
        while self._next < len(self._recvs) and self._recvs[self._next][0] < limit:
            if not self._post(self._recvs[self._next][1]):
                return
            self._next += 1

    def _post(self, action: Action) -> bool:
        sched, s, mb = self.schedule, action.stage, action.microbatch
        if action in self._posted_actions:
            return True
        if action.kind is Kind.RECV_B:
            shapes = self._grad_shapes(s, mb)
            if shapes is None:
                return False
            for t in sched.consumers(s):
                if sched.placement[t] != self.rank:
                    self._expect((s, t, 1), mb, shapes)
        else:
            for src in sched.sources(s):
                if sched.placement[src] != self.rank:
                    known = self._edges.last(("in", src, s, mb))
                    shapes = [] if known is None else layout(known)
                    self._expect((src, s, 0), mb, shapes)
        self._posted_actions.add(action)
        return True

    def _expect(self, edge: tuple[int, int, int], mb: int, shapes: Shapes) -> None:
        dev = self._local_device(edge)
        frame = frame_of(shapes, dev)
        buffers = frame.buffers()
        works = [self._recv_one(edge, b) for b in buffers]
        self._posted.setdefault(edge, []).append(Incoming(mb, frame, works, buffers))

    def ensure(self, action: Action) -> None:
        """Post the receive of ``action`` (and those before it) if not posted yet."""
        while action not in self._posted_actions and self._next < len(self._recvs):
            if not self._post(self._recvs[self._next][1]):
                raise RuntimeError(f"{self._recvs[self._next][1]} before the forward of its stage")
            self._next += 1

    # -- waiting -----------------------------------------------------------------------

    def _wait(self, work: Any, what: str, peer: int) -> None:
        """Wait for ``work`` from ``peer`` (a global rank), which the heartbeat publishes
        meanwhile (a rank timing out on this one follows it to the rank it waits for)."""
        start = time.perf_counter()
        waiting_for(peer)
        try:
            work.wait(timedelta(seconds=self.timeout))
        except Exception as exc:
            raise transfer_failed(self.channel, what, exc, peer) from exc
        finally:
            waiting_for(None)
            self.waited += time.perf_counter() - start

    def _arrive(self, edge: tuple[int, int, int], mb: int, what: str) -> tuple[Incoming, int]:
        """Wait for the message of microbatch ``mb`` on ``edge``: ``(message, code)``. The
        receives were posted in the order the peer sends, so the one posted for ``mb``
        holds its message, whichever the passes take first."""
        queue = self._posted.get(edge, [])
        at = next((i for i, msg in enumerate(queue) if msg.mb == mb), None)
        if at is None:
            raise RuntimeError(f"{what}: no receive was posted")
        msg = queue.pop(at)
        peer, named = self._peer(edge), self._named(edge)
        self.closing.post()  # idle now, unless the header is there already
        self._wait(msg.works[0], f"{what} (header)", named)
        code, got = msg.frame.header(msg.buffers)
        if code == POISON:
            raise poisoned(self.channel, named, what, self.timeout)
        if got != mb or msg.mb != mb:
            raise RuntimeError(
                f"{what}: rank {named} sent microbatch {got} where {mb} was expected; the "
                "ranks' schedules list this edge's receives in another order than its sends"
            )
        for work in msg.works[1:]:
            self._wait(work, what, named)
        self._proven(edge, mb, peer)
        return msg, code

    def receive_forward(self, action: Action, source: int) -> Any:
        """The input of ``action`` (a forward) from stage ``source`` on another rank.

        The edge's messages come in the sender's order (its receives were posted so), which
        the passes need not follow: messages sent before this one are taken first and kept
        for their passes, since a changed description's payload follows its header on the
        edge's side tag, which pairs in the order sent too."""
        s, mb = action.stage, action.microbatch
        self.ensure(Action(s, Kind.RECV_F, mb))
        edge = (source, s, 0)
        if (edge, mb) in self._early:
            return self._early.pop((edge, mb))
        queue = self._posted.get(edge, [])
        if any(msg.mb == mb for msg in queue):
            while queue[0].mb != mb:
                sooner = queue[0].mb
                self._early[(edge, sooner)] = self._take_forward(edge, sooner)
        return self._take_forward(edge, mb)

    def _take_forward(self, edge: tuple[int, int, int], mb: int) -> Any:
        """Receive the message of ``mb`` on forward ``edge`` and rebuild its tree."""
        source, s, _ = edge
        what = str(Action(s, Kind.RECV_F, mb))
        msg, code = self._arrive(edge, mb, what)
        cache_key = ("in", source, s, mb)
        if code == 0:
            description = self._edges.last(cache_key)
            if description is None:
                raise RuntimeError(f"{what}: a repeated description arrived before any")
            tensors = self._to_stage(msg.frame.leaves(msg.buffers), s)
        else:
            raw = torch.empty(code, dtype=torch.uint8, device=self._device(s))
            peer = self._peer(edge)
            self._wait(self._recv_one(edge, raw, side=True), f"{what} (description)", peer)
            description = Description.from_bytes(raw.cpu().numpy().tobytes())
            tensors = empty_leaves(description, self._device(s))
            works = [self._recv_one(edge, t, side=True) for t in tensors]
            for work in works:
                self._wait(work, what, peer)
            tensors = self._to_stage(tensors, s)
        self._edges.remember(cache_key, description)
        mark_gradients(description, tensors)
        return rebuild(description, tensors)

    def receive_backward(self, action: Action) -> list[list[torch.Tensor | None]]:
        """The gradients of stage ``action.stage``'s output from each consumer on another
        rank (None where the consumer's stage gave that leaf none); the forward sends to
        those consumers are then complete (they were used)."""
        sched, s, mb = self.schedule, action.stage, action.microbatch
        recv = Action(s, Kind.RECV_B, mb)
        self.ensure(recv)
        out: list[list[torch.Tensor | None]] = []
        for t in sched.consumers(s):
            if sched.placement[t] == self.rank:
                continue
            msg, code = self._arrive((s, t, 1), mb, str(recv))
            leaves = self._to_stage(msg.frame.leaves(msg.buffers), s)
            out.append(with_nones(code, leaves) if code else cast(_Grads, leaves))
            for key in self._forward_sends.pop((s, t, mb), []):
                entry = self._sends.pop(key, None)  # else awaited already (pipeline_posted)
                if entry is not None:
                    # Done: the consumer computed on what it carried (so it never blocks).
                    entry[0].wait(timedelta(seconds=self.timeout))
        return out
