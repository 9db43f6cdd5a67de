"""Bucket plans: which gradients are reduced together, and in which order.

A plan is frozen data. It is computed once (purely, from byte sizes), can be printed,
hashed, saved as JSON and replayed by any backend, so torch and JAX reduce exactly the
same groups of gradients. The assignment reproduces PyTorch's
``torch.distributed._compute_bucket_assignment_by_size`` for the same inputs, so a plan
computed here is the plan PyTorch's DDP would use. The plan itself,
:class:`~xgrad.bucket_plan.BucketPlan`, is :mod:`xgrad.bucket_plan` (re-exported here
with :data:`NO_LIMIT`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from xgrad.bucket_plan import NO_LIMIT as NO_LIMIT
from xgrad.bucket_plan import BucketPlan as BucketPlan

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
#: the largest bucket cap the backends take: PyTorch's DDP keeps caps in int64.
MAX_BUCKET_BYTES = 2**63 - 1


def _check_inputs(
    nbytes: Sequence[int],
    limits: Sequence[int],
    keys: Sequence[Hashable] | None,
    sparse: Sequence[bool] | None,
    order: Sequence[int] | None,
) -> None:
    if len(nbytes) == 0:
        raise ValueError("assign_buckets needs at least one parameter: nbytes is empty")
    for i, n in enumerate(nbytes):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"nbytes[{i}] = {n!r}: expected a byte count >= 0")
    if len(limits) == 0:
        raise ValueError("limits is empty: expected at least one bucket cap in bytes")
    for i, lim in enumerate(limits):
        if isinstance(lim, bool) or not isinstance(lim, int) or lim < 0:
            # 0 closes a bucket after every parameter, as PyTorch's assignment does.
            raise ValueError(f"limits[{i}] = {lim!r}: expected a byte cap >= 0")
    if keys is not None and len(keys) != len(nbytes):
        raise ValueError(f"keys has {len(keys)} entries for {len(nbytes)} parameters")
    if sparse is not None and len(sparse) != len(nbytes):
        raise ValueError(f"sparse has {len(sparse)} entries for {len(nbytes)} parameters")
    if order is not None and sorted(order) != list(range(len(nbytes))):
        raise ValueError(
            f"order must be a permutation of 0..{len(nbytes) - 1}: got {list(order)[:20]!r}"
        )


def assign_buckets(
    nbytes: Sequence[int],
    limits: Sequence[int],
    *,
    keys: Sequence[Hashable] | None = None,
    sparse: Sequence[bool] | None = None,
    order: Sequence[int] | None = None,
) -> BucketPlan:
    """Group parameters into buckets exactly as PyTorch's DDP does.

    Parameters are visited in ``order`` (default ``0..n-1``). Each key (dtype and device,
    for PyTorch) fills its own open bucket; a bucket closes as soon as its size reaches
    the key's current limit, after which that key moves on to the next limit (the last
    one repeats). A parameter whose gradient is sparse gets a bucket to itself, with no
    limit (recorded as 0). Without ``order`` the buckets are sorted by their smallest
    parameter index, which is the order PyTorch returns; DDP then launches them reversed
    (see :func:`ddp_initial_plan`). With ``order`` — a rebuild from the order in which
    gradients became ready — buckets keep the order in which they were closed, and the
    buckets still open at the end follow in the reverse of the order their keys first
    appeared, the order PyTorch's hash map of open buckets gives them (it puts each new
    key first; checked against PyTorch's assignment on random mixed-dtype cases). Where
    the buckets lie decides which bucket index a comm hook sees for them.

    Args:
        nbytes: bytes of each parameter's gradient (numel times element size).
        limits: bucket caps in bytes; the last one repeats.
        keys: per parameter, what must not be mixed in one bucket (e.g. ``(dtype, device)``).
        sparse: per parameter, whether its gradient is sparse.
        order: the order in which to visit parameters (a permutation of their indices).

    Raises:
        ValueError: on negative sizes, empty or negative limits, mismatched lengths or
            an ``order`` that is not a permutation; the message names the value.
    """
    _check_inputs(nbytes, limits, keys, sparse, order)
    visit = range(len(nbytes)) if order is None else order
    closed: list[tuple[tuple[int, ...], int]] = []
    open_indices: dict[Hashable, list[int]] = {}
    open_size: dict[Hashable, int] = {}
    open_limit: dict[Hashable, int] = {}
    limit_pos: dict[Hashable, int] = {}
    for index in visit:
        if sparse is not None and sparse[index]:
            closed.append(((index,), 0))
            continue
        key = None if keys is None else keys[index]
        bucket = open_indices.setdefault(key, [])
        bucket.append(index)
        open_size[key] = open_size.get(key, 0) + nbytes[index]
        pos = limit_pos.setdefault(key, 0)
        open_limit[key] = limits[pos]
        if open_size[key] >= limits[pos]:
            closed.append((tuple(bucket), limits[pos]))
            open_indices[key] = []
            open_size[key] = 0
            limit_pos[key] = min(pos + 1, len(limits) - 1)
    for key in reversed(open_indices) if order is not None else open_indices:
        if open_indices[key]:
            closed.append((tuple(open_indices[key]), open_limit[key]))
    if order is None:
        closed.sort(key=lambda entry: min(entry[0]))
    return BucketPlan(tuple(b for b, _ in closed), tuple(lim for _, lim in closed))


_MIB = 1024 * 1024


def cap_mb_to_bytes(value: object, name: str = "bucket_cap_mb") -> int:
    """A bucket cap given in MiB (DDP's ``bucket_cap_mb``) as bytes, checked.

    The check happens here, where the user's argument name is still known: further down
    a bad cap would only surface as ``limits[0] = -1048576``.

    Args:
        value: the cap in MiB, a finite number >= 0 (0, as in PyTorch's DDP: a bucket
            per parameter).
        name: the argument's name, for the message (``bucket_cap_mb``,
            ``first_bucket_cap_mb``, ``bucket_cap_mb_list[2]``...).

    Raises:
        TypeError: ``value`` is not a number (a bool is not one).
        ValueError: ``value`` is not finite or is negative (PyTorch's DDP takes a
            negative ``bucket_cap_mb`` as no cap, which the torch DDP copies in
            ``ddp_caps``; here it is refused as the mistake it likely is).

    Example:
        >>> cap_mb_to_bytes(0.5)
        524288
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of MiB, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} = {value!r}: expected a finite bucket cap in MiB >= 0")
    # A tiny positive cap still means "one parameter per bucket", not a zero-byte cap;
    # 0 is PyTorch's zero-byte cap (it closes a bucket after every parameter, even an empty one).
    return 0 if value == 0 else max(1, int(value * _MIB))


def ddp_bucket_caps(
    bucket_cap_bytes: int | None = None, first_bucket_cap_bytes: int | None = None
) -> tuple[int, int]:
    """DDP's ``(first bucket cap, bucket cap)`` in bytes for the caps a user gave.

    ``None`` means DDP's default: 25 MiB with a 1 MiB first bucket. An explicit cap is
    used for the first bucket too unless that one is given as well, as in PyTorch.
    """
    cap = DEFAULT_BUCKET_BYTES if bucket_cap_bytes is None else bucket_cap_bytes
    if first_bucket_cap_bytes is not None:
        return first_bucket_cap_bytes, cap
    return (DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_bytes is None else cap), cap


def ddp_initial_plan(
    nbytes: Sequence[int],
    *,
    keys: Sequence[Hashable] | None = None,
    sparse: Sequence[bool] | None = None,
    bucket_cap_bytes: int | None = None,
    first_bucket_cap_bytes: int | None = None,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
) -> BucketPlan:
    """The plan PyTorch's DDP starts with, in launch order.

    DDP does not trust the definition order when it will rebuild buckets anyway (no
    unused parameters searched, or a static graph): it starts with one bucket for all
    and rebuilds from the observed order after the first iteration. Otherwise it uses a
    small first bucket and then ``bucket_cap_bytes``. Either way it launches the buckets
    in reverse, since gradients arrive roughly in reverse definition order.

    The caps follow :func:`ddp_bucket_caps`.
    """
    first, cap = ddp_bucket_caps(bucket_cap_bytes, first_bucket_cap_bytes)
    if static_graph or not find_unused_parameters:
        limits = [NO_LIMIT]
    elif first < cap:
        limits = [first, cap]
    else:
        limits = [cap]
    return assign_buckets(nbytes, limits, keys=keys, sparse=sparse).reversed()


def rebuild_plan(
    nbytes: Sequence[int],
    ready_order: Sequence[int],
    *,
    keys: Sequence[Hashable] | None = None,
    sparse: Sequence[bool] | None = None,
    bucket_cap_bytes: int = DEFAULT_BUCKET_BYTES,
    first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
) -> BucketPlan:
    """Buckets rebuilt from the order in which gradients became ready (DDP's rebuild).

    The first bucket gets the small cap so the earliest gradients start reducing soon.
    """
    return assign_buckets(
        nbytes,
        [first_bucket_cap_bytes, bucket_cap_bytes],
        keys=keys,
        sparse=sparse,
        order=ready_order,
    )
