"""Private process groups (the DDP's, the pipeline's lanes), named alike on every member.

PyTorch names a group made with ``use_local_synchronization=True`` by its ranks and by the
number of groups this process has registered. That number differs on a rank that is not
in some earlier group: every rank calls ``new_group`` for it, but only its members
register it. Made that way, a private group of every rank would wait for its members under
different names (a hang, or a store timeout) in any program that made a subgroup first. So
a group of every rank is made by every rank without local synchronisation, and named by
the count of groups made so far, which is the same on all.

A group of some of the ranks (a DDP or a pipeline on a subgroup) is made by its members
alone, and PyTorch's name for it (a hash of its ranks and of the count of groups the
process registered) differs as well between members that are not in the same earlier
groups: made that way, the DDP on ranks 1 and 2 after a group of ranks 0 and 1 hung in its
construction for PyTorch's default 30 minutes. So it is named by the members' own group
(whose name its members share, or they could not have made it) and by how many private
groups this process made from that one, the same on every member since they make them in
the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

__all__ = ["gloo_twin", "group_count", "pass_private_group", "private_group", "require_member"]

#: per (what is counted, group name): how many this process counted on that group.
_COUNTS: dict[tuple[str, str], int] = {}


def group_count(what: str, group: Any = None, start: int = 0) -> int:
    """The next number of ``what`` on ``group`` (``None``: the default group) in this
    process: ``start``, ``start + 1``, ... Counted per group, not per process, so the
    members of a group number alike even when some also belong to other groups (they
    make those groups' DDPs, steps and private groups too)."""
    pg: Any = dist.group.WORLD if group is None else group
    key = (what, str(dist.distributed_c10d._get_process_group_name(pg)))
    n = _COUNTS.get(key, start)
    _COUNTS[key] = n + 1
    return n


def private_group(
    ranks: Sequence[int],
    *,
    parent: Any = None,
    timeout: float | None = None,
    backend: str | None = None,
) -> Any:
    """A new group of global ``ranks``; every one of them calls this, in the same order.

    ``parent``: the group of those ranks the private one serves (the DDP's or the
    pipeline's; ``None``: the default group), whose name names a private group of some of
    the ranks.
    """
    delta = None if timeout is None else timedelta(seconds=timeout)
    members = sorted(ranks)
    if len(members) != dist.get_world_size():
        group = _named_after(members, parent, delta, backend)
        if group is not None:
            return group
    return dist.new_group(
        members,
        timeout=delta,
        backend=backend,
        use_local_synchronization=len(members) != dist.get_world_size(),
    )


def pass_private_group(ranks: Sequence[int], *, parent: Any = None) -> bool:
    """Count the private group :func:`private_group` would make now without making it: for
    a rank that finds its peers gave that group up (they counted it, and name their next
    one after it). False where it cannot be counted here (a group split from a default
    group bound to a device, a PyTorch whose private c10d parts differ): make it then.

    Made anyway, the group reads the address a peer that gave it up left in the store,
    and gloo spends its connect timeout on it (10 s with a 2 s group timeout) while the
    peer moves on to its next group; each making the one the other had left, the two
    never met again.
    """
    members = sorted(ranks)
    if len(members) == dist.get_world_size():
        try:
            dist.distributed_c10d._process_group_name(members, use_hashed_name=False)
        except AttributeError:  # (as new_group counts)
            return False
        return True
    if _parent_name(parent) is None:  # made by new_group, which names it itself
        return False
    group_count("private group", parent)
    return True


def _parent_name(parent: Any) -> str | None:
    """The name a private group of some ranks is named after (``parent``'s, ``None``: the
    default group's), or ``None`` where such a group cannot be named here (and
    ``new_group`` makes and names it): a default group bound to a device (its subgroups
    are split from it with every rank), or a PyTorch whose private c10d parts differ.
    Asked alike where a group is made (:func:`_named_after`) and where one is counted
    without being made (:func:`pass_private_group`), so both count the same groups."""
    c10d = dist.distributed_c10d
    try:
        world = c10d._world
        default = c10d._get_default_group()
        if default.bound_device_id is not None or default not in world.pg_map:
            return None
        name = world.pg_names.get(parent if parent is not None else default)
    except (AttributeError, TypeError):
        return None
    return None if name is None else str(name)


def _named_after(
    members: list[int], parent: Any, timeout: timedelta | None, backend: str | None
) -> Any:
    """The group of ``members`` (sorted, this rank among them) named after ``parent``, made
    as ``new_group`` makes one; ``None`` where that cannot be done here
    (:func:`_parent_name`)."""
    parent_name = _parent_name(parent)
    if parent_name is None:
        return None
    c10d = dist.distributed_c10d
    try:
        world = c10d._world
        default_backend, store = world.pg_map[c10d._get_default_group()]
        chosen = dist.Backend(backend or default_backend)
        made = group_count("private group", parent)
        group, _ = c10d._new_process_group_helper(
            len(members),
            members.index(dist.get_rank()),
            members,
            chosen,
            store,
            cast(Any, f"xgrad_private_{parent_name}_{made}"),  # a GroupName, a str
            timeout=timeout if timeout is not None else c10d._get_default_timeout(chosen),
        )
        world.pg_group_ranks[group] = {g: i for i, g in enumerate(members)}
    except (AttributeError, KeyError, TypeError):
        return None
    return group


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


#: per process group (by name) that is not plain gloo, its gloo twin (:func:`gloo_twin`).
_twins: dict[str, Any] = {}


def gloo_twin(group: Any, timeout: float) -> Any:
    """``group`` if it is a gloo group, else a private gloo group of the same ranks (made at
    the first call on every rank, in the same order, as any group is; then kept).

    For messages whose protocol needs gloo's point-to-point where the user's group is NCCL
    (or has a backend per device): distributed autograd's passes need tags that keep a
    context's streams (and a failed context's leftovers) apart, and receives posted ahead
    that never hold up a send to the same peer. NCCL ignores tags and puts a pair's sends
    and receives on one stream, so a round trip (A to B to A) would deadlock there; through
    gloo, CUDA tensors are staged in host memory.
    """
    if dist.get_backend(group) == "gloo":
        return group
    name = str(dist.distributed_c10d._get_process_group_name(group))
    twin = _twins.get(name)
    if twin is None:
        ranks = dist.get_process_group_ranks(group)
        twin = _twins[name] = private_group(ranks, parent=group, timeout=timeout, backend="gloo")
    return twin
