"""One open distributed autograd context on one rank: its links, sends, receives, ledger, exit.

:mod:`.dist_autograd` is the API; this is the state behind one ``context_id`` until the
block is left (dropped then, so the next context starts clean).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from xgrad.failure import RankError
from xgrad.failure_wait import wait_until
from xgrad.heartbeat import waiting_for
from xgrad.torch_backend import dist_leftovers
from xgrad.torch_backend.dist_bytes import POISON
from xgrad.torch_backend.dist_graveyard import bury, bury_sent
from xgrad.torch_backend.dist_hooks import Seen
from xgrad.torch_backend.dist_inbox import Inbox
from xgrad.torch_backend.dist_ledger import Ledger, ProbingChannel
from xgrad.torch_backend.dist_left import context_namespace
from xgrad.torch_backend.dist_pass import DistBackwardError, DistBackwardUnresponsiveError
from xgrad.torch_backend.dist_self import ToSelf
from xgrad.torch_backend.dist_watch import wait_here
from xgrad.torch_backend.dist_wire import Link, header_device
from xgrad.torch_backend.failure import failure_channel, group_ranks, wait_posted
from xgrad.torch_backend.private_groups import gloo_twin
from xgrad.torch_backend.weak_hooks import weak_method

__all__ = ["Context"]


class Context:
    """The state of one open context on this rank (dropped when it closes).

    Args:
        context_id: the user-facing id.
        pg: the process group; name: its name; seq: the context's number on the group.
        timeout: seconds any wait of the context may last.
        leader: whether a pass ends through the group's lowest rank (else every rank
            tells every other).
        step: the context's step label (``repr`` of ``context(step=...)``; None: none),
            carried by every tensor it sends and checked by every receive.
    """

    def __init__(
        self,
        context_id: int,
        pg: Any,
        name: str,
        seq: int,
        timeout: float,
        *,
        leader: bool,
        step: str | None = None,
    ) -> None:
        self.id = context_id
        self.step = step
        self.pg = pg
        self.name = name
        self.seq = seq
        self.timeout = timeout
        self.ranks = group_ranks(pg)
        self.me = dist.get_rank()
        self.channel = ProbingChannel(failure_channel(pg, context_namespace(seq)))
        # The ledger calls back into the context weakly: a bound method would be a cycle,
        # and every context (its tensors, the graph they hold) would wait for the
        # collector instead of going when its block is left (full collections of about
        # 50 ms on a rank, in a pass of a few milliseconds).
        self.ledger = Ledger(
            self.channel.store, self.channel.prefix, self.me, self.ranks,
            weak_method(self.release), step,
        )  # fmt: skip
        self.channel.ledger = self.ledger
        #: the group the messages go on (a gloo twin of a group that is not gloo)
        self.wire = gloo_twin(pg, timeout)
        self.device = header_device(self.wire)
        self._leader = leader
        self.links: dict[int, Link] = {}
        self.to_self = ToSelf(self.me)
        # (peer, k, tensor, the edge its gradient enters, taken at the send)
        self.sends: list[tuple[int, int, torch.Tensor, Any]] = []
        # (peer, k, tensor, its RecvBackward node)
        self.recvs: list[tuple[int, int, torch.Tensor, Any]] = []
        self.counts: dict[tuple[str, int], int] = {}
        self.works: list[Any] = []
        #: hooks and flags registered on nodes while the context is open (:mod:`.dist_hooks`)
        self.seen = Seen()
        self.grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graph_freed = False
        self.in_backward = False  # send and recv are refused meanwhile (see _current)
        # the torch nodes a pass without retain_graph ran, freed at the exit (dist_release)
        self.ran: tuple[Any, ...] = ()
        # Whether this rank already raised the context's failure to the user.
        self.reported = False
        # Whether a failed pass already answered what its peers wait for (with poison).
        self.answered = False

    def error(self, exc: RankError) -> DistBackwardError:
        """The user's error for a failure of the context (which is marked as reported)."""
        self.reported = True
        cls = DistBackwardError if exc.failure.kind == "error" else DistBackwardUnresponsiveError
        return cls(self.id, exc)

    def rank_of(self, peer: Any, arg: str) -> int:
        """``peer`` checked as a rank of the context's group (this rank too: a send to
        itself, :mod:`.dist_self`)."""
        if not isinstance(peer, int) or isinstance(peer, bool):
            raise TypeError(f"{arg}={peer!r} must be an int rank")
        if peer not in self.ranks:
            raise ValueError(
                f"{arg}={peer} is not a rank of the context's group {self.ranks} "
                f"(this is rank {self.me})"
            )
        return peer

    def link(self, peer: Any, arg: str) -> Link:
        """The link to another rank of the group (made, and ``peer`` checked, on first use:
        ``send`` and ``recv`` have checked it already)."""
        link = self.links.get(peer)
        if link is None:
            if self.rank_of(peer, arg) == self.me:
                raise ValueError(f"{arg}={peer} is this rank, which has no link to itself")
            group_peer = dist.get_group_rank(self.wire, peer)
            link = self.links[peer] = Link(
                self.wire, self.channel.store, self.channel.prefix, self.me, peer, group_peer,
                self.seq, self.device, None if self.step is None else self.step.encode(),
            )  # fmt: skip
        return link

    def inbox(self) -> Inbox:
        """Post the receives of a backward pass: from every peer, its gradients, its "done"."""
        for peer in self.ranks:
            if peer != self.me:
                self.link(peer, "peer")
        sizes: dict[int, list[int]] = {}
        for peer, _, t, _ in self.sends:
            sizes.setdefault(peer, []).append(t.numel() * t.element_size())
        # the peer sent to last first: its gradients are likely to come back first
        latest = {peer: i for i, (peer, *_) in enumerate(self.sends)}
        expect = {p: sizes[p] for p in sorted(latest, key=latest.__getitem__, reverse=True)}
        return Inbox(
            self.name, self.links, expect, self.owed(), self.channel, self.timeout,
            dones=self.dones(),
        )  # fmt: skip

    def leader(self) -> int | None:
        """The rank that collects the others' "done" (None: every rank tells every other)."""
        return min(self.ranks) if self._leader else None

    def dones(self) -> list[int]:
        """The peers this rank exchanges "done" with."""
        leader = self.leader()
        if leader is None or leader == self.me:
            return [p for p in self.ranks if p != self.me]
        return [leader]

    def owed(self) -> dict[int, list[int]]:
        """Peer -> byte sizes of the gradients this rank answers it with in each pass."""
        owe: dict[int, list[int]] = {}
        for peer, _, t, _ in self.recvs:
            owe.setdefault(peer, []).append(t.numel() * t.element_size())
        return owe

    def poison(self) -> None:
        """A failure outside backward: answer every message a peer's pass would wait for."""
        owe = self.owed()
        for peer in self.ranks:
            if peer == self.me:
                continue
            try:
                link = self.link(peer, "peer")
            except ValueError:  # this rank destroyed the group in the context: no peer waits
                return
            link.start_backward(owe.get(peer, ()))
            try:
                for _ in owe.get(peer, ()):
                    bury(*link.send_backward(POISON, 0, None))
                if peer in self.dones():
                    bury(*link.send_backward(POISON, 0, None, final=True))
            except RuntimeError:  # gloo: that peer's connection is gone; nothing waits
                continue
        self.answer_unreceived()

    def answer_unreceived(self) -> None:
        """After a failure: poison the gradient of every tensor a peer sent that this rank
        did not receive (a misuse; the peer's pass waits for it, and nothing else of this
        rank's answers it)."""
        for link in list(self.links.values()):
            try:
                for _ in range(link.unreceived()):
                    bury(*link.release(final=False))
            except RuntimeError:  # gloo: that peer's connection is gone; nothing waits
                continue

    def release(self) -> None:
        """Misuse seen while this rank is in a pass, maybe on another thread than the pass's:
        poison every gradient and the "done" a peer may wait for from this rank, the
        tensors it did not receive too (a poison nobody receives stays in the graveyard;
        its tag is never reused)."""
        for peer, link in list(self.links.items()):
            try:
                for _ in range(self.ledger.grecvd.get(peer, 0)):
                    bury(*link.release(final=False))
                bury(*link.release(final=True))
            except RuntimeError:  # gloo: that peer's connection is gone; nothing waits
                continue
        self.answer_unreceived()

    def number(self, what: str, peer: int) -> int:
        k = self.counts.get((what, peer), 0)
        self.counts[(what, peer)] = k + 1
        return k

    def wait(self, work: Any, what: str, peer: int, link: Link | None = None) -> None:
        """Wait for a transfer whose other side is posted (announced or confirmed).

        With ``link`` (a forward receive: its sender announced it, but gloo moves the data
        only once this side posted, through the sender's communication thread, which a
        sender frozen since then does not run) the watchdog reads the heartbeats meanwhile
        and names a sender that stopped, instead of the wait running out the timeout.
        """
        try:
            if link is None:
                wait_posted(work, self.channel, timeout=self.timeout, what=what, peer=peer)
            else:
                wait_here(work, self.channel, link.pg, link.group_peer, self.timeout, what, peer)
        except RankError as exc:
            raise self.error(exc) from None

    def wait_for(self, ready: Any, what: str, peer: int | None = None) -> None:
        """Wait until ``ready()`` (for ``peer``: published with the heartbeat, and named
        when the wait times out while it lives and waits for no rank)."""
        before = waiting_for(peer)
        try:
            peers = () if peer is None else (peer,)
            wait_until(ready, self.channel, timeout=self.timeout, what=what, peers=peers)
        except RankError as exc:
            raise self.error(exc) from None
        finally:
            waiting_for(before)

    def close(self) -> None:
        """Make sure every send was received: an exit barrier on the store, then the sends.

        Every rank leaves through the barrier (whether a rank still has sends in flight is
        not known to the others), which passes once every rank arrived and every tensor
        sent was received (:meth:`Ledger.exit_amount`), so past it every receive was made;
        a disagreement is named by the ledger's probe. After a failure this rank already
        raised (and the user caught), nothing is awaited.
        """
        if self.reported:
            bury_sent(self.works)
            return
        self.to_self.check_received()
        store, key, world = self.channel.store, f"{self.channel.prefix}/exit", len(self.ranks)
        # The last rank to arrive learns it from its own add (no lookup after it).
        if store.add(key, self.ledger.exit_amount()) != world:
            self.wait_for(lambda: int(store.get(key)) == world, "exit, waiting for every rank")
        self.ledger.enter("forward")  # past the barrier: nothing left to probe
        for peer, (work, _) in self.works:
            self.wait(work, f"context exit, send to rank {peer}", peer)
        try:
            self.channel.check()
        except RankError as exc:
            raise self.error(exc) from None
        self.forget()

    def forget(self) -> None:
        """Delete what this clean context left in the store, so that a context per step
        does not grow the store by a key per send and per context for the whole run.

        This rank's forward headers: every one was read (every receive was made, the exit
        barrier says). What earlier contexts left (:mod:`.dist_leftovers`): every rank is
        past this context's barrier, so none reads them any more. What a peer may still
        read, this context's exit counter and probe records, is left to the next.
        """
        for link in self.links.values():
            link.forget_headers()
        base, _, seq = self.channel.prefix.rpartition("/")
        assert seq == str(self.seq), (self.channel.prefix, self.seq)
        store, lowest = self.channel.store, self.me == min(self.ranks)
        dist_leftovers.sweep(self.name, store, base, self.seq, lowest=lowest)
        dist_leftovers.keep(self.name, self.ledger.written() + self.channel.written())

    def leave_failed(self) -> None:
        """A failed context: keep every key this rank wrote in it, for a later clean
        context to delete (its peers may read them until they leave this one)."""
        keys = [key for link in self.links.values() for key in link.headers()]
        dist_leftovers.keep(self.name, keys + self.ledger.written() + self.channel.written())
