"""The start of a pipeline step: its number and tag base, and the wait for every rank's
start before the step makes its private groups.

Kept apart from :mod:`~xgrad.torch_backend.pipeline_edges`, which knows the edges of a step
once it runs: these run before any edge exists (the step's channel and the store alone),
and settle, once for every rank, whether the step goes on at all (the failed steps set
aside until then: :mod:`.pipeline_aside`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from xgrad.failure import FailureChannel, RankError, error_for
from xgrad.failure_wait import wait_until
from xgrad.heartbeat import COLLECTIVE, waiting_for
from xgrad.torch_backend.private_groups import group_count

__all__ = ["next_step", "start_keys", "step_tag", "wait_all_started"]


#: gloo tags (one per step, edge, direction and side, so that the messages of a failed
#: step, never received, cannot be taken for those of a later one) stay below this.
_TAG_LIMIT = 1 << 30


def next_step(group: Any) -> int:
    """The number of the step this process starts now on ``group`` (1, 2, ...): counted
    per pipeline group, so every rank counts alike (the channel namespace and the tag of
    a step)."""
    return group_count("pipeline step", group, start=1)


def wait_all_started(
    channel: FailureChannel, members: Sequence[int], timeout: float, lanes: int = 1
) -> list[int]:
    """Before a step makes its private groups: every rank of ``members`` started the step
    (global ranks), or one of them posted a failure to it, raised here. Returns each
    member's ``lanes`` (the groups it is about to make, see ``pipeline_lanes``).

    ``dist.new_group`` waits for its members with no way to be told otherwise, so a rank
    whose step fails before the group (a batch it cannot split) would leave its peers
    there, to pair their step with its next one. It posts to the step's channel instead,
    and the peers, waiting here, raise its error.

    Whether the step goes on is settled once for every rank (:func:`_settle`): a rank that
    came later than a peer's timeout saw every start (the peer's too) and went on into
    ``new_group``, where it waited for ever for the peer that had given up.
    """
    store, prefix = channel.store, channel.prefix
    store.set(f"{prefix}/started/{channel.rank}", str(lanes).encode())
    keys = [f"{prefix}/started/{r}" for r in members]

    def missing() -> list[int]:
        return [r for r, key in zip(members, keys, strict=True) if not store.check([key])]

    # Published with the heartbeat: a peer whose own wait leads here does not take this
    # rank, waiting for all, for the late one.
    before = waiting_for(COLLECTIVE)
    try:
        wait_until(
            lambda: store.check(keys),  # a lookup: a FileStore appends every write
            channel,
            timeout=timeout,
            what="the start of the step (every rank calls step)",
            # On a timeout, the ranks that have not started are the ones waited for: one
            # still busy in its own code (asleep past the last step's timeout) is named,
            # not this rank.
            peers=missing,
        )
    except RankError:
        if not _settle(channel, go=False):
            raise
        # A peer saw every start first: all go on, and the failure this rank posted
        # fails the step on every rank at its next look at the channel.
    else:
        if not _settle(channel, go=True):
            failure = channel.poll() or channel.post(
                "the start of the step", "another rank gave up the step's start", kind="timeout"
            )
            raise error_for(failure, channel.rank)
    finally:
        waiting_for(before)
    return [int(store.get(key)) for key in keys]


def start_keys(channel: FailureChannel) -> tuple[str, ...]:
    """The keys :func:`_settle` writes to a step's channel (to delete after the step)."""
    return (f"{channel.prefix}/start/deciders", f"{channel.prefix}/start/verdict")


def _settle(channel: FailureChannel, *, go: bool) -> bool:
    """Whether the step goes on: the first rank to decide (it saw every start, ``go``, or
    gave up) decides for all, through one counter of the store; the others read it."""
    deciders, verdict = start_keys(channel)
    store = channel.store
    if store.add(deciders, 1) == 1:
        store.set(verdict, b"go" if go else b"stop")
        return go
    deadline = time.monotonic() + 1.0  # the first decider writes it right after its ticket
    while not store.check([verdict]):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return store.get(verdict) == b"go"


def step_tag(index: int, stages: int) -> int:
    """The tag base of step ``index`` (its edges' tags stay below the tag limit)."""
    return index % max(1, _TAG_LIMIT // (4 * stages * stages))
