"""The edges of one rank's pipeline step: who is at the other end, their tags, the sends
kept until done, and the poison a failed rank sends. The steps' numbering and the wait
for every rank's start, which come before any edge, are
:mod:`~xgrad.torch_backend.pipeline_start` (re-exported here).

:class:`EdgeBook` is the part of :class:`~xgrad.torch_backend.pipeline_comm.StepWire`
that knows the edges; the posting ahead and the waiting are in
:mod:`~xgrad.torch_backend.pipeline_comm`, whose docstring describes the protocol.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from xgrad.failure import FailureChannel
from xgrad.failure_wait import wait_until
from xgrad.pipeline import Action, Kind, Schedule
from xgrad.torch_backend.failure import Waiter, transfer_failed
from xgrad.torch_backend.pipeline_close import StepClose
from xgrad.torch_backend.pipeline_frame import Frame
from xgrad.torch_backend.pipeline_posted import PostedPlan
from xgrad.torch_backend.pipeline_route import Edge, WirePlan
from xgrad.torch_backend.pipeline_start import (
    next_step,
    start_keys,
    step_tag,
    wait_all_started,
)

__all__ = [
    "POISON",
    "EdgeBook",
    "Incoming",
    "next_step",
    "start_keys",
    "step_tag",
    "wait_all_started",
]

#: header code of a message whose sender failed (its failure is in the channel).
POISON = -1

#: seconds the step's last sends are awaited before the wait also watches the channel.
_QUICK = 0.05


class Incoming:
    """One expected message: its frame and the buffers (and receives) posted for it."""

    __slots__ = ("buffers", "frame", "mb", "works")

    def __init__(self, mb: int, frame: Frame, works: list[Any], buffers: list) -> None:
        self.mb = mb
        self.frame = frame
        self.works = works  # the header's receive first, then the leaves' (unpacked)
        self.buffers = buffers


#: where every message of a step is built and received (see ``EdgeBook``).
_HOST = torch.device("cpu")


class EdgeBook:
    """The edges of this rank in one step, and its sends until they are done."""

    def __init__(
        self,
        plan: WirePlan,
        schedule: Schedule,
        rank: int,
        groups: Sequence[Any],
        ranks: Sequence[int],
        tag: int,
        channel: FailureChannel,
        timeout: float,
        device: Callable[[int], torch.device],
    ) -> None:
        self.schedule, self.rank, self._ranks = schedule, rank, list(ranks)
        self.plan, self.group = plan, groups[0]
        # Per edge the group of its direction's lane and the peer's rank in it.
        up = 1 if len(groups) > 1 else 0
        self._routes = {
            e: (groups[up if e in plan.upstream else 0], ranks[q]) for e, q in plan.peers.items()
        }
        self.channel, self.timeout = channel, timeout
        # The lanes are gloo groups (pipeline_lanes), whose transport reads and writes host
        # memory only ("writev: Bad address" from a CUDA pointer): messages are built and
        # received on the CPU, and ``_to_stage`` moves what lands to the stage's device.
        self._stage_device = device
        self._device: Callable[[int], torch.device] = lambda stage: _HOST
        self._tag = tag
        self._remaining = dict(plan.sends)  # (s, t, dir) -> messages still to send
        # Posted sends not yet waited, with their tensors (a gloo send must be waited once:
        # a second wait blocks for a next send); per (stage, consumer, mb) a forward's.
        self._sends: dict[int, tuple[Any, torch.Tensor]] = {}
        self._forward_sends: dict[tuple[int, int, int], list[int]] = {}
        #: receives posted, per edge (s, t, dir), in the order their messages come.
        self._posted: dict[tuple[int, int, int], list[Incoming]] = {}
        self._keys = itertools.count()
        #: when set, a message from a peer that proves it posted the receives of some of
        #: this rank's sends lets those sends be awaited at once (see pipeline_posted).
        self.posted: PostedPlan | None = None
        self._unproven: list[tuple[int, int, list[int]]] = []  # (peer, its receive, keys)
        # The end-of-step exchange (its receives posted at the first wait, in _arrive, or
        # at its run); its tag is that of the edge from stage 0 to itself, which no step has.
        first = min(schedule.stages_of(rank))
        self.closing = StepClose(
            self.group,
            self._ranks,
            rank,
            self._tag_of((0, 0, 0), False),
            self._device(first),
            channel,
            timeout,
            POISON,
        )

    @property
    def globals(self) -> list[int]:
        """Schedule rank -> global rank (what errors and heartbeats name; set by the step,
        for the end-of-step exchange too, which keeps the list: no reference back here)."""
        return self.closing.globals

    @globals.setter
    def globals(self, ranks: list[int]) -> None:
        self.closing.globals = list(ranks)

    def _to_stage(self, tensors: list[torch.Tensor], stage: int) -> list[torch.Tensor]:
        """Received ``tensors`` (on the wire device) on ``stage``'s device."""
        dev = self._stage_device(stage)
        return [t if t.device == dev else t.to(dev) for t in tensors]

    def _peer(self, edge: Edge) -> int:
        """The schedule rank at the other end of ``edge``."""
        return self.plan.peers[edge]

    def _named(self, edge: Edge) -> int:
        """The global rank at the other end of ``edge`` (as errors name ranks)."""
        return self.globals[self.plan.peers[edge]]

    def _local_device(self, edge: tuple[int, int, int]) -> torch.device:
        """The device of this rank's end of ``edge``."""
        s, t, _ = edge
        return self._device(s if self.schedule.placement[s] == self.rank else t)

    def _tag_of(self, edge: tuple[int, int, int], side: bool) -> int:
        n = self.schedule.num_stages
        s, t, d = edge
        return (((self._tag * n + s) * n + t) * 2 + d) * 2 + int(side)

    def _send_one(
        self, edge: tuple[int, int, int], tensor: torch.Tensor, side: bool = False
    ) -> int:
        """Post one send: its key in ``_sends`` (whose work holds the tensor until done)."""
        group, peer = self._routes[edge]
        try:
            work = group.send([tensor], peer, self._tag_of(edge, side))
        except RuntimeError as exc:
            # A connection a peer's timed-out wait closed: the peer's post names it.
            raise transfer_failed(self.channel, "send", exc, self._named(edge)) from exc
        key = next(self._keys)
        self._sends[key] = (work, tensor)
        return key

    def _recv_one(
        self, edge: tuple[int, int, int], tensor: torch.Tensor, side: bool = False
    ) -> Any:
        group, peer = self._routes[edge]
        try:
            return group.recv([tensor], peer, self._tag_of(edge, side))
        except RuntimeError as exc:
            raise transfer_failed(self.channel, "receive", exc, self._named(edge)) from exc

    def _expecting(self, peer: int, receive: Action, keys: list[int]) -> None:
        """Sends ``keys`` are matched by ``peer``'s ``receive`` (posted ahead by it)."""
        if self.posted is not None:
            self._unproven.append((peer, self.posted.position[receive], keys))

    def _proven(self, edge: tuple[int, int, int], mb: int, peer: int) -> None:
        """A message of ``edge`` for ``mb`` came from ``peer``: await (and drop) the sends
        whose receives it had posted when it sent it; gloo writes them without the peer."""
        if self.posted is None or not self._unproven:
            return
        s, t, d = edge
        sent = Action(s, Kind.SEND_F, mb) if d == 0 else Action(t, Kind.SEND_B, mb)
        frontier = self.posted.proven(peer, sent)
        left = []
        for item in self._unproven:
            if item[0] != peer or item[1] >= frontier:
                left.append(item)
                continue
            for key in item[2]:
                entry = self._sends.pop(key, None)
                if entry is not None:
                    try:
                        entry[0].wait(timedelta(seconds=self.timeout))
                    except Exception as exc:
                        named = self.globals[peer]
                        raise transfer_failed(self.channel, "send", exc, named) from exc
        self._unproven = left

    def poison(self, origin: int | None = None) -> None:
        """After this rank failed (its failure posted first): tell every peer that still
        expects a message from it, so the peer stops waiting and reads the channel.

        The sends complete when the peers take them (a peer behind may post its receive
        later): the runtime keeps the group until every rank started its next step (each
        has left the failed one, so none still needs a poison), then aborts it. ``origin``,
        the live rank whose failure this rank raises, is not told: it raised first and
        posts no receive again.
        """
        for edge, left in self._remaining.items():
            if left > 0:
                # The group may be closed already (a dead peer): nothing to tell then.
                with contextlib.suppress(Exception):
                    if self._peer(edge) == origin:
                        raise LookupError  # nothing to tell it
                    # A header alone: gloo completes a posted receive with a shorter message.
                    poison = Frame([], self._local_device(edge)).pack(POISON, -1, None)[0]
                    self._send_one(edge, poison)
                self._remaining[edge] = 0
        self.closing.poison(origin)

    def in_flight(self) -> list[tuple[Any, Any]]:
        """The step's transfers that may still be pending, as ``(work, its buffers)``: what
        a failed step keeps alive until its group is aborted (:mod:`.pipeline_aside`;
        gloo drops a send whose work is freed, and writes a receive into its buffer when
        it lands). Not the step's activations, which the wire's caller holds."""
        kept: list[tuple[Any, Any]] = list(self._sends.values())
        for queue in self._posted.values():
            kept += [(work, msg.buffers) for msg in queue for work in msg.works]
        return kept + self.closing.in_flight()

    def finish(self, waiter: Waiter) -> None:
        """Wait until every send of the step is done (watching the channel: a peer that
        failed may never receive), then until every rank's step is done (or raise the
        failure of the one that failed: see :mod:`~xgrad.torch_backend.pipeline_close`)."""
        pending = [w for w, _ in self._sends.values()]
        self._forward_sends.clear()
        if pending:
            # Usually done at once (the receives were posted ahead): then one look at the
            # channel below is all; else the wait watches the channel.
            done, error = waiter.submit(_All(pending))
            if not done.wait(_QUICK):
                wait_until(done, self.channel, timeout=self.timeout, what="sends")
            if error:
                raise transfer_failed(self.channel, "sends", error[0], None) from error[0]
        self._sends.clear()
        self._unproven.clear()
        self.closing.run()


class _All:
    """The works of a step's sends as one work for a :class:`Waiter`."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
