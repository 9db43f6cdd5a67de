"""A process group this process aborted or destroyed, named when a user of it goes on.

After :func:`~xgrad.torch_backend.failure.abort_group` (or ``destroy_process_group``)
c10d forgets the group: a DDP made on it that is used again looked its store up there and
raised a bare ``KeyError`` naming the group object. The rank that aborted the group gets,
instead, what its peers read from its last heartbeat ("rank 0: aborted the process
group ...; make a new group to go on"), worded for itself. Kept apart from the failure
channel: this reads c10d's table of groups and nothing else.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist

from xgrad.failure import Failure, RankError, error_for

__all__ = ["gone_error", "note_aborted"]

#: the groups this process aborted (their objects live on in the DDPs made on them).
_ABORTED: weakref.WeakSet[Any] = weakref.WeakSet()


def note_aborted(group: Any) -> None:
    """Remember that this process aborted ``group`` (None: every group it knows, as
    aborting the default group drops them all); called before the abort forgets them."""
    if group is None or group == dist.group.WORLD:
        _ABORTED.update(_known())
    else:
        _ABORTED.add(group)


def _known() -> list[Any]:
    """The groups c10d knows now (private to c10d: none where it lacks the table)."""
    return list(getattr(dist.distributed_c10d._world, "pg_map", {}))


def gone_error(group: Any, rank: int, user: str) -> RankError | None:
    """The error for a ``user`` (e.g. "DistributedDataParallel") going on with
    ``group`` when this process aborted or destroyed it, naming ``rank`` (this one);
    None while c10d still knows the group.

    A ``RankError`` (a ``RuntimeError``, as PyTorch's DDP raises there: gloo's
    "Connection closed by peer"), not the peers' ``RankUnresponsiveError``: nothing
    timed out here, the rank's own code dropped the group.
    """
    try:
        if group in dist.distributed_c10d._world.pg_map:
            return None
    except (AttributeError, TypeError):  # a c10d without the table: nothing to say
        return None
    how, call = (
        ("aborted", "abort_group") if group in _ABORTED else ("destroyed", "destroy_process_group")
    )
    message = (
        f"{how} the process group ({call}) that this {user} reduces over: it takes no "
        f"part in the group's collectives again; make a new group, and a new {user} on "
        "it, to go on"
    )
    return error_for(Failure(rank, "", message), rank)
