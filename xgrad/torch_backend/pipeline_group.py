"""The private group of a pipeline step's sends and receives: made at a step's start
(first step, after a failure), with every rank's start awaited and the schedule agreed;
set aside when a step fails (its transfers cannot be cancelled) and aborted once its
poison went out. A step fails on every rank or on none (its end is an exchange through
every rank, :mod:`~xgrad.torch_backend.pipeline_close`), so the ranks always agree on
whether the next step keeps the group.

:class:`StepGroups` is the part of :class:`~xgrad.torch_backend.pipeline.PipelineRuntime`
that owns that group; what a failed step does with it (post, poison, reset, tell the
stages' DDPs) is its base, :mod:`~xgrad.torch_backend.pipeline_failed`; the event loop is
in :mod:`~xgrad.torch_backend.pipeline`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from xgrad.failure import FailureChannel, RankError
from xgrad.raising import raise_from
from xgrad.torch_backend.agreement import check_agreement
from xgrad.torch_backend.failure import check_lost, failure_channel
from xgrad.torch_backend.group_keys import StoreKeys, group_keys
from xgrad.torch_backend.pipeline_aside import abort_set_aside
from xgrad.torch_backend.pipeline_comm import StepWire
from xgrad.torch_backend.pipeline_failed import StepFailures
from xgrad.torch_backend.pipeline_lanes import agree_lanes, open_lanes
from xgrad.torch_backend.pipeline_posted import PostedPlan
from xgrad.torch_backend.pipeline_route import WirePlan
from xgrad.torch_backend.pipeline_start import start_keys, wait_all_started

__all__ = ["StepGroups"]


class StepGroups(StepFailures):
    """Opens a step on the private group, and sets the group aside when a step fails."""

    _digest: str  # the digest of the schedule the next step runs
    _p2p_ranks: list[int]
    _lanes: int
    _route: WirePlan
    _tag: int
    _plan: PostedPlan | None
    post_ahead: int
    release_sends: str

    def _open_step(self, index: int, mine: set[int], early: Any) -> FailureChannel:
        """Step ``index``'s channel (returned), private group and schedule agreement;
        ``early``: this rank's split batch, or the exception splitting it raised (posted
        to the channel, then raised)."""
        sched = self.schedule
        self._index = index
        self._channel = channel = failure_channel(self.group, f"pipeline/step{index}")
        if isinstance(early, Exception):
            channel.post("", f"step failed: {type(early).__name__}: {early}")
            self._keep_written(channel)
            raise early
        if self._p2p is None:
            # Only a step that makes a new group waits on the members (a failed step's
            # group is set aside with the private group): not looked up on every step.
            members = dist.get_process_group_ranks(self.group or dist.group.WORLD)
            if self._dying is not None and self._lost is not None:
                # The failed step lost a rank: its group is aborted now, not once every
                # rank started this step (the lost one would hold the wait for the whole
                # timeout; the live ones raised on its loss and wait for no poison).
                abort_set_aside(self._pipeline, step=self._dying)
            self._dying = None
            check_lost(channel, self._lost)  # before a new group waits on a lost rank
            self._lost = None
            # Sends and receives go through private groups of the pipeline's ranks (one
            # per direction where the cores allow: pipeline_lanes), made once every rank
            # showed it makes as many.
            counts = self._all_started(channel, members)
            # Every rank started this step, so each left every step before it: no peer can
            # still need the poison of a failed step set aside on this pipeline group
            # (this runtime's, or one a runtime dropped since left). Not aborted once every
            # poison was taken: a peer that raised on the first takes no other, and those
            # sends would hold this step for the whole timeout.
            abort_set_aside(self._pipeline, before=index)
            lanes = agree_lanes(counts)
            self._p2p = open_lanes(members, lanes, self.group)
            self._p2p_ranks = [dist.get_group_rank(self._p2p[0], g) for g in members]
            me = dist.get_group_rank(self._p2p[0], channel.rank)
            self._written += [group_keys(group, me) for group in self._p2p]
        if self._agreed != self._digest:
            # Every rank gathers the same digests, so a mismatch raises the same ValueError
            # everywhere; a hang on a schedule one rank does not share is ruled out (and on
            # a change between training and evaluation, a rank that does the other).
            check_agreement(
                "pipeline schedule (eval's forwards)" if self._evaluating else "pipeline schedule",
                self._digest,
                # A rank that evaluates while another trains says so in the difference.
                (lambda: "eval: the forwards alone\n" + sched.text())
                if self._evaluating
                else sched.text,
                where="PipelineRuntime",
                # On the step's private group, not the user's: a rank that never joins
                # (its peers train while it evaluates) leaves the all-gather pending, and
                # a pending collective on the user's group held the process at its exit;
                # the private group is set aside and aborted with the failed step's.
                group=self._p2p[0],
                timeout=self.timeout,
                channel=channel,
                device=self._device(min(mine)) if mine else "cpu",
            )
            self._agreed = self._digest
        return channel

    def _open_or_reset(self, index: int, mine: set[int], early: Any) -> FailureChannel:
        """:meth:`_open_step`; if it fails, this rank resets as its peers do, then raises."""
        try:
            return self._open_step(index, mine, early)
        except RankError as error:
            # A peer failed the step while this rank opened it (its agreement may have
            # completed there, not here): reset as that peer does, so both open the next
            # step alike (a fresh group, the schedule agreed again).
            self._reset(error, None)
            self._tell_replicas(error)
            if self._channel is None or self._channel.poll() != error.failure:
                raise  # not posted to this step (the last step's lost rank, raised again)
            raise_from(self._raised(error.failure, self._channel), error)
        except Exception as exc:  # this rank's batch it cannot split (posted by _open_step)
            # The peers reset as above: so does this rank, or after a switch between step
            # and eval (which agrees again on an open group) the ranks open the next step
            # on different groups, and it waits out the timeout.
            self._reset(None, None)
            self._tell_replicas(exc)
            raise

    def _all_started(self, channel: FailureChannel, members: list[int]) -> list[int]:
        counts = wait_all_started(channel, members, self.timeout, self._lanes)
        self._written.append(
            StoreKeys(
                channel.store, (f"{channel.prefix}/started/{channel.rank}", *start_keys(channel))
            )
        )
        return counts

    def _forget(self) -> None:
        """At the end of a good step: delete the keys this rank wrote to the store in it
        and in the failed steps before it (their tickets, the ranks' starts, the address
        this rank wrote to make each private group). The step ended through every rank
        (:mod:`~xgrad.torch_backend.pipeline_close`), so every rank is past the start of
        this step and has left the steps before it: none reads those keys any more
        (deleted earlier, a key could vanish between a reader's lookup and its ``get``,
        which then blocks for the store's timeout). A loop that catches a failed step and
        goes on keeps a bounded store; a good step that opened no group deletes nothing."""
        for keys in self._written:
            keys.delete()
        self._written.clear()

    def _new_wire(
        self, channel: FailureChannel, grad_shapes: Callable[[int, int], Any]
    ) -> StepWire:
        """The step's wire on the lanes :meth:`_open_step` made; with ``release_sends``
        "posted", told which receives the peers posted when (computed once per window)."""
        if self._p2p is None:
            raise RuntimeError(f"rank {self.rank}: the step's private groups are not open")
        wire = StepWire(
            self._route,
            self.schedule,
            self.rank,
            self._p2p,
            self._p2p_ranks,
            self._tag,
            self._edges,
            channel,
            self.timeout,
            self._device,
            grad_shapes,
            self.post_ahead,
        )
        # Errors and heartbeats name global ranks; schedule rank r is the group's rank r.
        wire.globals = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        if self.release_sends == "posted":
            if self._plan is None or self._plan.window != self.post_ahead:
                self._plan = PostedPlan(self.schedule, self.post_ahead)
            wire.posted = self._plan
        return wire
