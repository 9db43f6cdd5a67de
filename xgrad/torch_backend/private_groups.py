"""Private process groups (the DDP's, the pipeline's lanes), named alike on every member.

PyTorch names a group made with ``use_local_synchronization=True`` by its ranks and by the
number of groups this process has registered. That number differs on a rank that is not
in some earlier group: every rank calls ``new_group`` for it, but only its members
register it. Made that way, a private group of every rank would wait for its members under
different names (a hang, or a store timeout) in any program that made a subgroup first. So
a group of every rank is made by every rank without local synchronisation, and named by
the count of groups made so far, which is the same on all. Only a group of some of the
ranks (a DDP or a pipeline on a subgroup) is made by its members alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["private_group", "require_member"]


def private_group(
    ranks: Sequence[int], *, timeout: float | None = None, backend: str | None = None
) -> Any:
    """A new group of global ``ranks``; every one of them calls this, in the same order."""
    return dist.new_group(
        list(ranks),
        timeout=None if timeout is None else timedelta(seconds=timeout),
        backend=backend,
        use_local_synchronization=len(ranks) != dist.get_world_size(),
    )


def require_member(group: Any, role: str) -> None:
    """Refuse at once a rank outside ``group`` (PyTorch reports its size as -1 there, and
    what follows fails far from the cause); ``role``: what the group's ranks do with it.

    Raises:
        ValueError: this rank is not in ``group``.
    """
    if dist.distributed_c10d._rank_not_in_group(group):
        raise ValueError(
            f"group: rank {dist.get_rank()} is not a member of this process group; only its "
            f"ranks {role}"
        )
