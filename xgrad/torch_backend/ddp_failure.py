"""The DDP on the failure channel: every wait bounded and watched, every failure named.

Each synchronised step (a forward pass with its backward) gets a fresh namespace of the
torch backend's failure channel (:mod:`xgrad.torch_backend.failure`). A rank that fails
in the forward pass, a gradient hook, a communication hook or the reduction posts where;
the others, waiting on a collective that will never complete, see it within a poll and
raise the same :class:`~xgrad.failure.RankError` ("rank 1 in comm hook, bucket 0: ..."),
with a line for each other rank whose failure had reached the channel ("also rank 2 ...").
A rank that died or froze stops its heartbeat and is named the same way; a wait that
outlives ``timeout`` raises too.

The DDP's collectives run on a private copy of its group whose own timeout is the DDP's,
so an operation left pending by a failed step expires with it and
``destroy_process_group()`` returns. After a failed step every rank sees the failure in
that step's namespace at its next synchronised forward pass, drops the private group
(whatever was left pending on it, on any rank, goes with it) and makes a fresh one: the
next step starts in step on every rank. A rank late for that fresh group, which a peer
gave up waiting for it, raises the peer's failure instead of making it (what the peer
left of it in the store held it for gloo's connect timeout): both make the next step's
group alike. The failed step's keys in the store go once every rank has read them
(:mod:`.ddp_leftovers`).

This module is the watch itself: the step's channel and the private group; its bounded
waits and what a failed wait drops are :mod:`.ddp_waits`'s. The DDP's collectives issued
on that group are :mod:`.ddp_watched_comm`'s, and what a failed backward pass leaves
behind is dropped at the next forward pass by :mod:`.ddp_recover`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from xgrad.failure import (
    Failure,
    FailureChannel,
    RankError,
    default_seconds,
    describe,
    error_for,
)
from xgrad.failure_errors import FAILURE_KINDS
from xgrad.heartbeat import COLLECTIVE, waiting_for
from xgrad.local_errors import as_local
from xgrad.raising import raise_from
from xgrad.torch_backend.ddp_leftovers import drop_read_failures, read_failure
from xgrad.torch_backend.ddp_skipped import drop_old_skips
from xgrad.torch_backend.ddp_spin import resolve_spin
from xgrad.torch_backend.ddp_waits import StepWaits
from xgrad.torch_backend.failure import check_lost, failure_channel, start_heartbeat
from xgrad.torch_backend.group_keys import StoreKeys
from xgrad.torch_backend.lost_rank import absent_peer, check_aborted
from xgrad.torch_backend.private_groups import group_count, pass_private_group, private_group

__all__ = ["StepWatch"]


class StepWatch(StepWaits):
    """The failure channel of one DDP, step by step, and the private group it reduces on.

    Args:
        group: the user's process group (``None``: the default group).
        timeout: seconds any wait may last.
    """

    def __init__(self, group: Any, timeout: float) -> None:
        self.user_group = group
        self.timeout = timeout
        # Counted per group, not per process: ranks that also ran a DDP on another group
        # (that not every member is in) made more DDPs, and each rank's channels were then
        # named apart (a failure posted on one was never seen by the other).
        self.instance = group_count("DDP", group)
        self.step = 0
        self.poll = default_seconds("poll_interval")
        self.world = dist.get_world_size(group)
        #: the group's global ranks, and the lowest (it deletes the keys of skip rounds and
        #: of failed steps).
        self.ranks: list[int] = list(dist.get_process_group_ranks(group or dist.group.WORLD))
        self.lowest = min(self.ranks)
        #: seconds a wait polls its collective before it blocks (:mod:`.ddp_spin`), for a
        #: collective of CPU tensors and for one of CUDA tensors (by default none).
        self.spin = resolve_spin(self.world, self.poll)
        self.cuda_spin = resolve_spin(self.world, self.poll, "cuda")
        #: on the lowest rank: ``(step, namespace)`` of skip rounds whose keys are still
        #: to be deleted (:mod:`.ddp_skipped`).
        self.skipped_steps: list[tuple[int, str]] = []
        #: on the lowest rank: namespaces of failed steps whose keys are still to be
        #: deleted (:mod:`.ddp_leftovers`).
        self.failed_steps: list[tuple[str, StoreKeys]] = []
        #: what this DDP's next wait for a bucket reads first (:mod:`.join_rounds`).
        self.deferred: Callable[[], None] | None = None
        #: the step whose skipped backward pass was last settled (once per step).
        self.settled = -1
        #: why the private group was dropped (a peer died or froze), until a new one is made.
        self.lost: RankError | None = None
        #: set by a begin_step that found the previous step failed, for the DDP's next
        #: forward pass, which checks the ranks' agreement again (on every rank alike).
        self.regrouped = False
        #: the last step this rank found failed at the start of the next (0: none), for
        #: the join rounds, which a failed step can leave entered by only some ranks
        #: (:func:`~.join_rounds.failed_round`).
        self.failed_at = 0
        #: the failure of the step the last :meth:`begin_step` ended (``None``: it did not
        #: fail), and the step at whose first forward pass this rank raised that step's
        #: failure (a pass that left buckets unreduced: :mod:`.join_leave`); -1: none.
        self.ended_failed: Failure | None = None
        #: no_sync forward passes since the step began (posted if it fails: ddp_which_step).
        self.nosync_passes = 0
        self.raised_at = -1
        self._last_namespace = self._namespace()
        # The channel first: its heartbeat tells who is there when the group cannot be made.
        self.channel: FailureChannel = failure_channel(group, self._last_namespace)
        self.group: Any = self._make_group("the DDP's process group")

    def current_group(self) -> Any:
        """The private group; the failure that lost it if it was dropped (never WORLD)."""
        if self.group is None:
            assert self.lost is not None
            raise error_for(self.lost.failure, self.channel.rank, also=self.lost.also)
        return self.group

    def _namespace(self, step: int | None = None) -> str:
        return f"ddp/{self.instance}/step/{self.step if step is None else step}"

    def channel_of(self, step: int) -> FailureChannel:
        """The failure channel of this DDP's step ``step`` (the current one's store)."""
        old = self.channel
        base = old.prefix[: len(old.prefix) - len(self._last_namespace)]
        return FailureChannel(old.store, base + self._namespace(step), old.rank, old.liveness)

    def _next_channel(self) -> FailureChannel:
        """The channel of the step just begun: a new namespace on the same store.

        The store, this rank and the peers' heartbeats stay the same from step to step,
        so they are shared with the last step's channel rather than looked up again
        (that took more than the rest of DDP's per-step bookkeeping together).
        """
        # restarted if it stopped, as failure_channel does (its first beat bounded)
        start_heartbeat(self.user_group, store=self.channel.store)
        channel = self.channel_of(self.step)
        self._last_namespace = self._namespace()
        return channel

    def _make_group(self, what: str) -> Any:
        """A new private group (``what``), or the error naming who it could not be made
        for: a peer dead, never started, or late (c10d's "Wait timeout" says none).

        While it is made, and its failure read, this rank says it waits for every rank
        (:func:`~xgrad.heartbeat.waiting_for`): a peer that gives up then names the one
        that waits for nobody, late, not a rank that waits here too. The heartbeats are
        read as it begins, so a counter that stood still since shows a stopped rank.
        """
        if self.channel.liveness is not None:
            self.channel.liveness.read(force=True)
        before = waiting_for(COLLECTIVE)
        started = time.monotonic()
        try:
            return private_group(
                self.ranks,
                parent=self.user_group,
                timeout=self.timeout,
                backend=dist.get_backend(self.user_group),
            )
        except RuntimeError as exc:  # "Wait timeout", "Connect timeout": a peer never came
            waited = time.monotonic() - started
            raise_from(absent_peer(self.channel, what, exc, waited), exc)
        finally:
            waiting_for(before)

    def _unless_given_up(self) -> None:
        """Before this rank makes the step's new group: raise the step's failure if a peer
        already posted it (it gave the group up, waiting for this late rank), the group
        counted as made, as the peer counted it (:func:`.pass_private_group`); both make
        the next step's group alike, and meet there."""
        given_up = self.channel.poll()
        if given_up is None or given_up.kind not in FAILURE_KINDS:
            return
        if pass_private_group(self.ranks, parent=self.user_group):
            raise error_for(given_up, self.channel.rank)

    # ----------------------------------------------------------------- steps

    def begin_step(self, polled: bool = False, hold_read: bool = False) -> Failure | None:
        """Start the next synchronised step; the previous step's failure, if it had one.

        Every rank calls this at the same forward pass, so every rank finds the same
        failure and replaces its private group at the same point. ``polled``: the caller
        read the channel just before (:func:`~.ddp_give_up.begin_next_step`): its answer
        stands, without another store round trip (a poll that finds nothing is not kept,
        and under load one costs a few hundred microseconds, a step's bookkeeping twice).
        ``hold_read``: the failed step's read mark is left to :mod:`.ddp_which_step`, which
        reads the peers' pass counts there first.
        """
        failed = self.channel.seen() if polled else self.channel.poll()
        self.ended_failed = failed
        if failed is not None:
            self.failed_at = self.step
        check_lost(self.channel, failed)  # a rank still dead or frozen: its error, not a hang
        if self.skipped_steps:
            drop_old_skips(self)
        if self.failed_steps:
            drop_read_failures(self)
        self.step += 1
        old = self.channel.prefix
        self.channel = self._next_channel()
        if failed is not None or self.group is None:
            check_aborted(self.channel, "the DDP's new process group")
            self._unless_given_up()
            self.group = self._make_group("the DDP's new process group")
            self.lost = None
        if failed is not None:
            read_failure(self, old, mark=not hold_read)
            self.regrouped = True
        return failed

    def post(self, where: str, exc: BaseException | str) -> RankError:
        """Report this rank's failure; the error every rank raises for the step's first one.
        ``exc`` may be the ``"Type: text"`` of an exception no longer at hand."""
        if isinstance(exc, RankError):
            return exc
        message = exc if isinstance(exc, str) else describe(exc)
        error = self._own(self.channel.post(where, message), where, message)
        # Also an instance of this rank's own exception's type: ``except ValueError``
        # around a forward pass catches it, as under PyTorch's DDP (xgrad.local_errors).
        return error if isinstance(exc, str) else as_local(error, exc)

    def _own(self, first: Failure, where: str, message: str) -> RankError:
        """The error for the step's ``first`` failure on a rank whose own failure was
        ``where``/``message``: when another rank's came first, naming after it the others
        in the channel (:meth:`~xgrad.failure.FailureChannel.others`), this rank's among
        them even if not read there (an earlier ticket not written yet ends the list), as
        the pipeline's errors do; its text said nothing of this rank's failure before,
        only its cause did."""
        rank = self.channel.rank
        if first.rank == rank:
            return error_for(first, rank)
        also = self.channel.others()
        if all(f.rank != rank for f in also):
            also.append(Failure(rank, where, message))
        return error_for(first, rank, also=also)

    def post_here(self, where: str, exc: BaseException | str) -> RankError:
        """:meth:`post`, with another group's failure (a ``RankError`` raised around this
        DDP: a pipeline's) relayed to this DDP's peers as it is: its origin, place and
        kind (a dead rank stays "unresponsive"), not as this live rank's."""
        if isinstance(exc, RankError):
            return error_for(self.channel.relay(exc.failure), self.channel.rank)
        return self.post(where, exc)

    def call(self, where: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``; a failure is posted and raised as the step's RankError."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise_from(self.post(where, exc), exc)
        except BaseException as exc:  # Ctrl-C, exit: the peers are told, here it stays as is
            self.post(where, exc)
            raise
