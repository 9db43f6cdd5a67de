"""The end of a pipeline step: no rank returns from ``step()`` before every rank's step is
done, or raises the failure of the rank whose step was not.

A rank's last actions may send nothing its peers wait for (stage 0's last backward), so
without this a failure there came after the peers had returned from ``step()`` with a
step that had failed elsewhere. Every rank ends its step with a tiny message exchange
on the step's private group, through pipeline rank 0, the leader::

    rank 1 ──done──▶ rank 0 ◀──done── rank 2        (each rank, once its sends are done)
    rank 1 ◀──done── rank 0 ──done──▶ rank 2        (rank 0, once it had every done)

The receives are posted at a rank's first wait for a message in the step (not at its
start, where stage 0's first forward waits on them), so a message moves without its
receiver and the exchange costs message latency only: one hop after the leader's own end
(in most schedules stage 0, on the leader, ends last), two after another rank's. A leader
gathering and answering was the cheapest shape measured on gloo at p = 4 on two cores
(per step, after the last rank's end: 0.47 ms against 0.62 ms for every rank telling every
other and 0.74 ms for a one-element all-reduce; at p = 2 the three were 0.13, 0.12 and
0.26 ms), and it needs no store round trip. A message is a single int64: 0 (done) or
:data:`~xgrad.torch_backend.pipeline_edges.POISON` (the sender failed; its failure is in
the channel), which a failing rank sends on the exchange's edges it has not used yet, as
it does on every edge a peer still waits on. So a failure in a rank's last action wakes
the ranks that are done at once (the leader's through the leader), and each raises the
origin's error. The waits are bounded by the runtime's timeout, through the failure
channel like every other wait: a killed peer fails them at once, a frozen one after the
timeout, named from the heartbeats.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any

import torch

from xgrad.failure import FailureChannel
from xgrad.torch_backend.failure import poisoned, transfer_failed

__all__ = ["LEADER", "StepClose"]

#: the pipeline rank that gathers every rank's end of step and answers each.
LEADER = 0

#: the message of a rank whose step ended well (its failure otherwise: ``POISON``).
_DONE = 0


class StepClose:
    """This rank's part of the end-of-step exchange of one step (receives: :meth:`post`).

    Args:
        group: the step's private group; ``ranks[r]`` is pipeline rank r's rank in it.
        rank: this pipeline rank.
        tag: the exchange's tag in this step (no edge of the step uses it).
        device: where the messages live (the device of this rank's first stage: NCCL).
        channel: the step's failure channel; ``timeout`` bounds the whole exchange.
        poison: the header code of a failed sender's message.

    Attributes:
        globals: pipeline rank -> global rank (as errors and heartbeats name ranks; the
            identity until the step sets it).
    """

    def __init__(
        self,
        group: Any,
        ranks: list[int],
        rank: int,
        tag: int,
        device: torch.device,
        channel: FailureChannel,
        timeout: float,
        poison: int,
    ) -> None:
        self._group, self._ranks, self._tag = group, ranks, tag
        self.globals = list(range(len(ranks)))
        self._device, self._channel, self._timeout = device, channel, timeout
        self._poison = poison
        self.rank = rank
        peers = [q for q in range(len(ranks)) if q != rank]
        # The leader hears from every peer and answers each; the others from the leader.
        self._peers = peers if rank == LEADER else [LEADER]
        self._incoming: dict[int, tuple[torch.Tensor, Any]] | None = None  # once posted
        self._unsent = set(self._peers)  # peers this rank has not told yet
        self._sends: list[tuple[Any, torch.Tensor]] = []

    def post(self) -> None:
        """Post the exchange's receives, if not yet: at the rank's first wait in the step
        (it has nothing to compute then), or at its end at the latest."""
        if self._incoming is None:
            self._incoming = {}
            for q in self._peers:
                buf = torch.empty(1, dtype=torch.int64, device=self._device)
                try:
                    work = self._group.recv([buf], self._ranks[q], self._tag)
                except RuntimeError as exc:  # gloo: a dead peer's connection is closed
                    what = "the end of the step (receive)"
                    raise transfer_failed(self._channel, what, exc, self.globals[q]) from exc
                self._incoming[q] = (buf, work)

    def _send(self, peer: int, code: int) -> None:
        message = torch.full((1,), code, dtype=torch.int64, device=self._device)
        try:
            work = self._group.send([message], self._ranks[peer], self._tag)
        except RuntimeError as exc:  # gloo: a dead peer's connection is closed
            what = "the end of the step (send)"
            raise transfer_failed(self._channel, what, exc, self.globals[peer]) from exc
        self._sends.append((work, message))  # the work holds its tensor until done
        self._unsent.discard(peer)

    def run(self) -> None:
        """After this rank's step is done (its sends too): tell the leader and wait for its
        answer (or, on the leader, wait for every peer and answer each).

        Raises:
            xgrad.failure.RankError: a peer failed (poison) or stopped answering, or
                ``timeout`` ran out.
        """
        deadline = time.monotonic() + self._timeout
        self.post()
        incoming = self._incoming or {}
        if self.rank != LEADER:
            self._send(LEADER, _DONE)
        leader = self.rank == LEADER
        what = "the end of the step" + (" (every rank's done)" if leader else " (the leader's)")
        for q in self._peers:
            buf, work = incoming.pop(q)
            # The leader's answer waits on every rank: the heartbeats name one that froze.
            self._wait(work, what, self.globals[q] if leader else None, deadline)
            if int(buf.item()) == self._poison:
                raise poisoned(self._channel, self.globals[q], what, self._timeout)
        if self.rank == LEADER:
            for q in self._peers:
                self._send(q, _DONE)
        # Each peer posted its receive before the message that came from it here (at its
        # first wait, or in this method): these sends are taken already, the waits only
        # collect them.
        sends, self._sends = self._sends, []
        for work, _ in sends:
            self._wait(work, "the end of the step (send)", None, deadline)

    def _wait(self, work: Any, what: str, peer: int | None, deadline: float) -> None:
        left = max(deadline - time.monotonic(), 1e-3)
        try:
            work.wait(timedelta(seconds=left))
        except Exception as exc:
            raise transfer_failed(self._channel, what, exc, peer) from exc

    def in_flight(self) -> list[tuple[Any, Any]]:
        """The exchange's sends and posted receives, as ``(work, buffer)``."""
        incoming = [(work, buf) for buf, work in (self._incoming or {}).values()]
        return [*self._sends, *incoming]

    def poison(self, origin: int | None) -> None:
        """After this rank failed (its failure posted first): tell the peers of the
        exchange it has not told yet, but ``origin`` (the live rank whose failure this
        rank raises: it raised first and waits for nothing more)."""
        for q in sorted(self._unsent):
            if q != origin:
                # The group may be closed already (a dead peer): nothing to tell then.
                with contextlib.suppress(Exception):
                    self._send(q, self._poison)
        self._unsent.clear()
