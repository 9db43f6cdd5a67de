"""Reducing a gradient pytree bucket by bucket inside ``pmap``/``shard_map``, with a BucketPlan.

The same :class:`~xgrad.buckets.BucketPlan` that drives torch's reducer drives the reduction
here: gradient leaves are taken in plan order, raveled and concatenated per bucket, each
bucket is reduced by one collective (with the chosen communication hook's arithmetic), and
the result is split back into leaves. Without a plan every leaf is reduced on its own, so
the effect of bucketing can be measured. Plans index parameters in torch's
``named_parameters()`` order; :func:`plan_order` maps them to ``jax.tree_util``'s leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xgrad import hooks as xgrad_hooks
from xgrad.buckets import BucketPlan, ddp_initial_plan
from xgrad.jax_backend import powersgd
from xgrad.powersgd import Layout, PowerSGD
from xgrad.reducer import GradBucket

#: communication hooks by name: ``xgrad.hooks``' own functions, run per bucket on JAX arrays
#: (so the arithmetic is literally the one torch's reducer runs): "allreduce" divides by the
#: world size and sums (torch's ``allreduce_hook``); "fp16" / "bf16" cast to float16 /
#: bfloat16, divide, sum in that dtype and cast back (torch's compression hooks);
#: "powersgd" is :class:`~xgrad.powersgd.PowerSGD` with PyTorch's ``PowerSGDState``
#: defaults (pass a ``PowerSGD(...)`` to choose its settings). Without a hook a bucket is
#: summed and then divided (the reducer's default).
HOOKS: tuple[str, ...] = (*xgrad_hooks.HOOKS, "powersgd")

#: a hook name, a :class:`~xgrad.powersgd.PowerSGD`, or None.
HookSpec = str | PowerSGD | None


def _key_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_names(tree: Any) -> list[str]:
    """A dotted name per leaf of ``tree``, in ``jax.tree_util`` flattening order.

    A flat dict keyed by torch's parameter names gives those names back; a nested
    ``{"layers": [{"weight": ...}]}`` gives ``"layers.0.weight"``, torch's spelling too.
    """
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [".".join(_key_name(e) for e in path) for path, _ in paths]


def plan_order(tree: Any, names: Sequence[str] | None) -> list[int]:
    """For each plan index ``i``, the position in ``tree``'s flattened leaves of parameter ``i``.

    Plans index parameters in torch's ``named_parameters()`` order, while ``jax.tree_util``
    flattens dicts in sorted key order; ``names`` (the parameter names in plan index order)
    bridges the two. Without ``names`` the flattening order is the plan order.

    Raises:
        ValueError: ``names`` does not name exactly the leaves of ``tree``.
    """
    found = leaf_names(tree)
    if names is None:
        return list(range(len(found)))
    position = {n: k for k, n in enumerate(found)}
    if sorted(names) != sorted(found) or len(set(names)) != len(names):
        missing = sorted(set(names) - set(found))
        extra = sorted(set(found) - set(names))
        raise ValueError(
            f"names do not match the gradient pytree's leaves: names without a leaf {missing}, "
            f"leaves without a name {extra}"
        )
    return [position[n] for n in names]


def plan_for(
    params: Any,
    *,
    names: Sequence[str] | None = None,
    bucket_cap_bytes: int | None = None,
    first_bucket_cap_bytes: int | None = None,
) -> BucketPlan:
    """A bucket plan for ``params`` as DDP fills it, in launch order (last parameters first).

    With ``bucket_cap_bytes=None`` it is DDP's default plan (1 MiB first bucket, then 25 MiB,
    launched reversed). Buckets never mix dtypes. ``names`` orders the leaves like torch's
    ``named_parameters()`` (see :func:`plan_order`).

    Raises:
        ValueError: a cap that is not a positive byte count (shown), or mismatched names.
    """
    leaves = jax.tree_util.tree_leaves(params)
    order = plan_order(params, names)
    arrays = [leaves[k] for k in order]
    nbytes = [int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays]
    keys = [str(np.dtype(a.dtype)) for a in arrays]
    for label, cap in (
        ("bucket_cap_bytes", bucket_cap_bytes),
        ("first_bucket_cap_bytes", first_bucket_cap_bytes),
    ):
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ValueError(f"{label}={cap!r}: expected a positive byte count")
    # DDP's bucketed plan (the one it uses when it will not rebuild), with its cap rules.
    return ddp_initial_plan(
        nbytes,
        keys=keys,
        bucket_cap_bytes=bucket_cap_bytes,
        first_bucket_cap_bytes=first_bucket_cap_bytes,
        find_unused_parameters=True,
    )


def _check_plan(plan: BucketPlan, num_leaves: int) -> None:
    if plan.num_params != num_leaves:
        raise ValueError(
            f"plan covers {plan.num_params} parameters but the gradient pytree has "
            f"{num_leaves} leaves (plan digest {plan.digest()[:12]})"
        )


def resolve_hook(hook: HookSpec) -> str | PowerSGD | None:
    """``hook`` as the reduction runs it: ``"powersgd"`` becomes ``PowerSGD()``.

    Raises:
        ValueError: an unknown hook name (the known ones are listed).
        TypeError: neither a name, a PowerSGD nor None.
    """
    if hook is None or isinstance(hook, PowerSGD):
        return hook
    if not isinstance(hook, str):
        raise TypeError(
            f"hook={hook!r}: expected None, a hook name from {HOOKS} or an xgrad.powersgd.PowerSGD"
        )
    if hook not in HOOKS:
        raise ValueError(
            f"hook={hook!r} is not a JAX comm hook; expected None, a PowerSGD or one of {HOOKS}"
        )
    return PowerSGD() if hook == "powersgd" else hook


def buckets_of(plan: BucketPlan | None, num_leaves: int) -> tuple[tuple[int, ...], ...]:
    """The plan's buckets, or one bucket per leaf (in plan index order) without a plan."""
    if plan is None:
        return tuple((i,) for i in range(num_leaves))
    _check_plan(plan, num_leaves)
    return plan.buckets


def powersgd_layouts(
    params: Any, plan: BucketPlan | None, names: Sequence[str] | None, config: PowerSGD
) -> tuple[list[Layout], list[Any]]:
    """Per bucket: PowerSGD's layout of its gradients and their dtype (for ``init``)."""
    leaves = jax.tree_util.tree_leaves(params)
    order = plan_order(params, names)
    buckets = buckets_of(plan, len(leaves))
    shapes = [[tuple(np.shape(leaves[order[i]])) for i in bucket] for bucket in buckets]
    dtypes = [jnp.result_type(leaves[order[bucket[0]]]) for bucket in buckets]
    return powersgd.bucket_layouts(shapes, config), dtypes


class _Reduced:
    """A collective already issued in the traced program: ``wait`` just hands its value over."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def wait(self) -> Any:
        return self._value


class AxisComm:
    """An ``xgrad.backend.Comm`` over a mapped JAX axis, for ``xgrad.hooks`` inside pmap/shard_map.

    Only what the per-bucket hooks need is traced: ``allreduce`` is ``lax.psum`` over the
    axis. The object collectives exchange Python objects between processes, which a traced
    program cannot do; bucket plans are fixed before tracing, so nothing asks for them.
    """

    def __init__(self, axis_name: str, world_size: int) -> None:
        self.axis_name = axis_name
        self._size = world_size

    @property
    def rank(self) -> int:
        """Hooks read only the size; a traced rank (``lax.axis_index``) is not an int."""
        raise TypeError(f"AxisComm over axis {self.axis_name!r} has no static rank")

    @property
    def size(self) -> int:
        return self._size

    def allreduce(self, buffer: Any) -> _Reduced:
        return _Reduced(lax.psum(buffer, self.axis_name))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        raise TypeError(f"AxisComm over axis {self.axis_name!r} cannot exchange objects ({obj!r})")

    def allgather_object(self, obj: Any) -> list[Any]:
        raise TypeError(f"AxisComm over axis {self.axis_name!r} cannot exchange objects ({obj!r})")


def reduce_flat(
    flat: Any, axis_name: str, world_size: int, hook: str | None, index: int = 0, last: bool = True
) -> Any:
    """Reduce one flat bucket over ``axis_name`` with ``hook``'s arithmetic (see ``HOOKS``)."""
    if hook is None:
        return lax.psum(flat, axis_name) / world_size
    bucket = GradBucket(index, flat, [flat], [], last)
    return xgrad_hooks.HOOKS[hook](AxisComm(axis_name, world_size))(bucket).wait()


def reduce_gradients(
    grads: Any,
    axis_name: str,
    *,
    world_size: int,
    plan: BucketPlan | None = None,
    names: Sequence[str] | None = None,
    hook: HookSpec = None,
    hook_state: powersgd.PowerSGDCarry | None = None,
) -> Any:
    """Average ``grads`` over ``axis_name``, one collective per bucket (or per leaf without a plan).

    Call inside ``jax.pmap`` or ``jax.shard_map`` with ``axis_name`` bound. In plan mode the
    leaves of bucket ``b`` are raveled in plan order and concatenated, the bucket is reduced
    by one collective, and the result is split back and reshaped; buckets are issued in
    plan order. Without a plan each leaf is reduced by its own collective, in plan index
    order. Either way the per-element arithmetic is the hook's, so bucketing changes how
    many collectives run, not the numbers.

    Args:
        grads: the local gradient pytree.
        axis_name: the mapped axis to reduce over.
        world_size: the size of that axis (the divisor of the mean).
        plan: bucket plan over the leaves, indexed in ``names`` order.
        names: parameter names in plan index order (see :func:`plan_order`).
        hook: None, a name from ``HOOKS`` or a :class:`~xgrad.powersgd.PowerSGD`.
        hook_state: PowerSGD's :class:`~xgrad.jax_backend.powersgd.PowerSGDCarry`, with
            this device's own error rows (shape ``(length,)``); required with PowerSGD.

    Returns:
        The averaged pytree; with PowerSGD, ``(averaged pytree, next hook_state)``.

    Raises:
        ValueError: an unknown hook, a plan that does not cover the leaves, a bucket that
            mixes dtypes (which DDP never builds), or PowerSGD without ``hook_state``.
    """
    hook = resolve_hook(hook)
    stateful = isinstance(hook, PowerSGD)
    if stateful and hook_state is None:
        raise ValueError(
            "hook=PowerSGD needs hook_state= (its PowerSGDCarry: see xgrad.jax_backend.powersgd.init)"
        )
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    order = plan_order(grads, names)
    buckets = buckets_of(plan, len(leaves))
    out: list[Any] = list(leaves)
    errors: list[Any] = []
    qs: list[Any] = []
    for b, bucket in enumerate(buckets):
        members = [order[i] for i in bucket]
        dtypes = {str(leaves[k].dtype) for k in members}
        if len(dtypes) > 1:
            raise ValueError(f"bucket {b} of the plan mixes dtypes {sorted(dtypes)}")
        flat = jnp.concatenate([jnp.ravel(leaves[k]) for k in members])
        if isinstance(hook, PowerSGD):
            assert hook_state is not None
            lay = powersgd.bucket_layouts([[tuple(leaves[k].shape) for k in members]], hook)[0]
            reduced, error, q = powersgd.reduce_bucket(
                flat, b, lay, hook, hook_state, axis_name, world_size
            )
            errors.append(error)
            qs.append(q)
        else:
            reduced = reduce_flat(flat, axis_name, world_size, hook, b, b == len(buckets) - 1)
        offset = 0
        for k in members:
            size = int(np.prod(leaves[k].shape))
            out[k] = reduced[offset : offset + size].reshape(leaves[k].shape)
            offset += size
    tree = jax.tree_util.tree_unflatten(treedef, out)
    if not isinstance(hook, PowerSGD):
        return tree
    assert hook_state is not None
    carry = powersgd.PowerSGDCarry(
        hook_state.iter + 1,
        tuple(errors) if hook.use_error_feedback else (),
        tuple(qs),
        hook_state.key,
    )
    return tree, carry
