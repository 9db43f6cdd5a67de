"""What a failed pipeline step does with its private group and its peers: this rank's
failure posted (or another group's relayed with its origin), the messages its peers wait
for poisoned, the group set aside and this rank reset for the next step, the stages' DDPs
and data-parallel replicas told, and the :class:`~xgrad.failure.RankError` each rank raises.

:class:`StepFailures` is the base of :class:`~xgrad.torch_backend.pipeline_group.StepGroups`,
kept apart from it: a step's group is opened (started, agreed on) there, and these run
only once a step failed, from the event loop's ``except`` clauses
(:mod:`~xgrad.torch_backend.pipeline`) and from an opening that failed.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from xgrad.failure import Failure, FailureChannel, RankError, describe, error_for
from xgrad.pipeline import Action
from xgrad.torch_backend.group_keys import StoreKeys
from xgrad.torch_backend.pipeline_aside import set_aside
from xgrad.torch_backend.pipeline_comm import StepWire
from xgrad.torch_backend.pipeline_ddps import tell_replicas
from xgrad.torch_backend.pipeline_stage_base import StageState
from xgrad.torch_backend.pipeline_wire import EdgeCache
from xgrad.torch_backend.stores import group_key

__all__ = ["StepFailures"]


class StepFailures(StageState):
    """Posts a step's failure, poisons its peers' waits, sets its group aside, resets."""

    _edges: EdgeCache
    _agreed: str | None  # the digest of the schedule the ranks last agreed on
    _p2p: tuple[Any, ...] | None  # the step's lanes (private groups), lane 0 first
    _lost: Failure | None
    _dying: int | None  # the failed step this runtime set aside (pipeline_aside)
    _index: int  # the number of the step opened last (on the pipeline group)
    _written: list[StoreKeys]
    _ddps: list[Any]  # the DDPs inside this rank's stages (told when a step fails)
    _ddp_steps: list[int]

    def _keep_written(self, channel: FailureChannel) -> None:
        """Keep the keys this rank's posts wrote to the step's channel, for :meth:`_forget`."""
        self._written.append(StoreKeys(channel.store, tuple(channel.written())))

    @property
    def _pipeline(self) -> str:
        """The pipeline group's name: what its steps are numbered and set aside under."""
        return group_key(self.group)

    def _pipeline_rank(self, rank: int) -> int:
        """The pipeline (group) rank of global ``rank``."""
        group: Any = self.group or dist.group.WORLD
        return dist.get_group_rank(group, rank)

    def _reset(self, error: RankError | None, wire: StepWire | None) -> None:
        """After a failed step: forget the descriptions (the peer may not have seen the
        last), set the private group of the failed step's transfers (``wire``'s, None when
        it failed before any) aside (receives posted ahead that gloo cannot cancel, sends
        never received; every rank saw the failure and makes a fresh one next step) to be
        aborted once its poison went out (next step, or at exit), and leave waiter threads
        parked on those transfers. The next step agrees on the schedule again: a peer's
        failure may have cut this rank's agreement short where the peer's had completed.
        A rank that stopped answering is remembered: the next step checks it first."""
        self._lost = (
            error.failure if error is not None and error.failure.kind == "unresponsive" else None
        )
        if self._channel is not None:
            self._keep_written(self._channel)
        self._edges.clear()
        self._agreed = None
        if self._p2p is not None:
            # Kept apart from this runtime, so that a loop that makes a new one after the
            # failure keeps the poison sends alive too (pipeline_aside).
            set_aside(self._pipeline, self._index, self._p2p, wire and wire.in_flight())
            self._dying = self._index
            self._p2p = None
        self._waiters.renew()

    def _failed_by(
        self, error: RankError, channel: FailureChannel, wire: StepWire, action: Action | None
    ) -> RankError:
        """What a step raises for a :class:`RankError` in ``action`` (the group reset)."""
        if channel.poll() != error.failure:
            # Another group's failure (a DDP inside a stage): this rank's action failed,
            # so the pipeline's peers are told, as for any exception.
            return self._raised(self._fail_here(channel, wire, action, error), channel)
        # The failure is posted: peers waiting on this rank stop now (a live origin has
        # stopped already; one outside this pipeline, a data-parallel peer whose failure
        # a rank of this pipeline relayed, is no peer here).
        members = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        live = error.failure.kind == "error" and error.rank in members
        wire.poison(self._pipeline_rank(error.rank) if live else None)
        self._reset(error, wire)
        self._tell_replicas(error)
        return self._raised(error.failure, channel)

    def _raised(self, failure: Failure, channel: FailureChannel) -> RankError:
        """The error this rank raises for the step's first ``failure``, naming the other
        ranks whose failures reached the channel by now (read, not waited for: two ranks
        that fail at once are both named, where the first alone hid the other)."""
        return error_for(failure, channel.rank, also=channel.others())

    def _tell_replicas(self, error: BaseException) -> None:
        """A failed step tells the data-parallel replicas (:func:`tell_replicas`); a failed
        evaluation does not: it reduces nothing and began no step of theirs, and telling
        them began one on this replica only (its DDPs' and ``dp_group``'s steps then
        paired with the replicas' next ones: wrong gradients without a word). And the
        gradients the step set aside go back into ``.grad`` (pipeline_scale)."""
        if self._scaling is not None:
            self._scaling.abandon()
            self._scaling = None
        if not self._evaluating:
            tell_replicas(error, self._ddps, self._ddp_steps, self._dp)

    def _fail_here(
        self, channel: FailureChannel, wire: StepWire, action: Action | None, exc: BaseException
    ) -> Failure:
        """Post this rank's failure in ``action``, poison what the peers wait for, reset.

        Another group's failure (a data-parallel peer's, through a DDP in a stage or the
        REDUCE_GRAD all-reduce) is relayed with its origin, place, kind (a dead rank
        stays "unresponsive") and text, not as this live rank's failure with it nested
        inside; and with where it reached the pipeline, which its own place (a DDP's
        "forward", "backward") does not say.
        """
        if isinstance(exc, RankError):
            f = exc.failure
            here = f"in {action}" if action is not None else "outside its actions"
            seen = f"{f.message}\n(raised in the pipeline by rank {channel.rank}, {here})"
            failure = channel.relay(Failure(f.rank, f.where, seen, f.kind))
        else:
            where = f"{action} failed" if action is not None else "step failed"
            failure = channel.post("", f"{where}: {describe(exc)}")
        wire.poison()
        self._reset(None, wire)
        self._tell_replicas(error_for(failure, channel.rank))
        return failure
