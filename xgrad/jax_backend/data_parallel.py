"""Data-parallel value-and-grad in JAX that reduces gradients bucket by bucket with a BucketPlan.

The same :class:`~xgrad.buckets.BucketPlan` that drives torch's reducer drives the reduction
here: gradient leaves are taken in plan order, raveled and concatenated per bucket, each
bucket is reduced by one collective (with the chosen communication hook's arithmetic), and
the result is split back into leaves. Without a plan every leaf is reduced on its own, so
the effect of bucketing can be measured. Two drivers run the same per-device step:
``jax.pmap`` (what older code uses) and ``jax.shard_map`` over a one-axis mesh (pmap is in
maintenance mode); they give identical numbers.

Example:
    >>> import numpy as np
    >>> from xgrad import models
    >>> from xgrad.jax_backend import models as jm
    >>> w = models.init_weights("mlp", 0, "float32")
    >>> x, y = models.make_batch("mlp", 0, 8, "float32")
    >>> step = data_parallel_value_and_grad(
    ...     jm.make_loss(jm.mlp), world_size=2, names=list(w),
    ...     plan=plan_for(w, bucket_cap_bytes=4096), mode="shard_map")
    >>> loss, grads = step(jm.to_params(w), x, y)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xgrad import hooks as xgrad_hooks
from xgrad.buckets import BucketPlan, ddp_initial_plan
from xgrad.jax_backend import powersgd
from xgrad.jax_backend.powersgd import PowerSGD
from xgrad.reducer import GradBucket

#: communication hooks by name: ``xgrad.hooks``' own functions, run per bucket on JAX arrays
#: (so the arithmetic is literally the one torch's reducer runs): "allreduce" divides by the
#: world size and sums (torch's ``allreduce_hook``); "fp16" / "bf16" cast to float16 /
#: bfloat16, divide, sum in that dtype and cast back (torch's compression hooks). Without a
#: hook a bucket is summed and then divided (``lax.pmean``, the reducer's default).
HOOKS: tuple[str, ...] = tuple(xgrad_hooks.HOOKS)

#: a hook name, a :class:`~xgrad.jax_backend.powersgd.PowerSGD`, or None.
HookSpec = str | PowerSGD | None

#: the two ways of running the per-device step.
MODES: tuple[str, ...] = ("pmap", "shard_map")

#: ``loss_fn(params, *batch) -> scalar``.
LossFn = Callable[..., Any]


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


def _check_hook(hook: HookSpec) -> None:
    if hook is not None and not isinstance(hook, PowerSGD) and hook not in HOOKS:
        raise ValueError(
            f"hook={hook!r} is not a JAX comm hook; expected None, a PowerSGD or one of {HOOKS}"
        )


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
        hook: None, ``"allreduce"``, ``"fp16"``, ``"bf16"`` (see ``HOOKS``) or a
            :class:`~xgrad.jax_backend.powersgd.PowerSGD` (torch's ``powerSGD_hook``).

    Raises:
        ValueError: an unknown hook, a plan that does not cover the leaves, or a bucket that
            mixes dtypes (which DDP never builds).
    """
    _check_hook(hook)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    order = plan_order(grads, names)
    out: list[Any] = list(leaves)
    if plan is None:
        for pos, k in enumerate(order):
            if isinstance(hook, PowerSGD):
                out[k] = powersgd.reduce_bucket([leaves[k]], pos, axis_name, world_size, hook)[0]
            else:
                last = pos == len(order) - 1
                out[k] = reduce_flat(leaves[k], axis_name, world_size, hook, pos, last)
        return jax.tree_util.tree_unflatten(treedef, out)
    _check_plan(plan, len(leaves))
    for b, bucket in enumerate(plan.buckets):
        members = [order[i] for i in bucket]
        dtypes = {str(leaves[k].dtype) for k in members}
        if len(dtypes) > 1:
            raise ValueError(f"bucket {b} of the plan mixes dtypes {sorted(dtypes)}")
        if isinstance(hook, PowerSGD):
            parts = [leaves[k] for k in members]
            for k, part in zip(
                members,
                powersgd.reduce_bucket(parts, b, axis_name, world_size, hook),
                strict=True,
            ):
                out[k] = part
            continue
        flat = jnp.concatenate([jnp.ravel(leaves[k]) for k in members])
        last = b == len(plan.buckets) - 1
        reduced = reduce_flat(flat, axis_name, world_size, hook, b, last)
        offset = 0
        for k in members:
            size = int(np.prod(leaves[k].shape))
            out[k] = reduced[offset : offset + size].reshape(leaves[k].shape)
            offset += size
    return jax.tree_util.tree_unflatten(treedef, out)


def _devices(world_size: int, devices: Sequence[Any] | None) -> list[Any]:
    available = list(jax.devices()) if devices is None else list(devices)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    if world_size > len(available):
        raise ValueError(
            f"world_size={world_size} needs {world_size} JAX devices but {len(available)} are "
            "available (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N or "
            "jax.config.update('jax_num_cpu_devices', N) before JAX starts)"
        )
    return available[:world_size]


def _check_batch(batch: Sequence[Any], world_size: int) -> None:
    for i, a in enumerate(batch):
        n = np.shape(a)[0] if np.ndim(a) else 0
        if n == 0 or n % world_size:
            raise ValueError(
                f"batch argument {i} has leading dimension {n}, which does not split evenly "
                f"over world_size={world_size}"
            )


def data_parallel_value_and_grad(
    loss_fn: LossFn,
    *,
    world_size: int,
    plan: BucketPlan | None = None,
    names: Sequence[str] | None = None,
    hook: HookSpec = None,
    mode: str = "shard_map",
    axis_name: str = "dp",
    devices: Sequence[Any] | None = None,
) -> Callable[..., tuple[Any, Any]]:
    """``step(params, *batch) -> (loss, grads)`` over ``world_size`` devices, data-parallel.

    Every array in ``batch`` is split along its leading axis into ``world_size`` equal
    contiguous shards (device ``r`` gets the ``r``-th); each device computes
    ``value_and_grad(loss_fn)`` on its shard, and the gradients are averaged with
    :func:`reduce_gradients` (bucketed when ``plan`` is given). The loss returned is the
    mean of the shard losses; the gradients are replicated, returned as one pytree.

    Args:
        loss_fn: ``loss_fn(params, *batch) -> scalar``.
        world_size: number of devices (the first ``world_size`` of ``devices``).
        plan: bucket plan (see :func:`plan_for`); None reduces leaf by leaf.
        names: parameter names in plan index order (see :func:`plan_order`).
        hook: communication hook (see ``HOOKS``).
        mode: ``"pmap"`` or ``"shard_map"``; both give identical numbers.
        axis_name: the name of the data-parallel axis.
        devices: the devices to use (default ``jax.devices()``).

    Raises:
        ValueError: bad mode, hook or world size (too few devices: the message says how to
            get more CPU devices).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    _check_hook(hook)
    devs = _devices(world_size, devices)

    def local_step(params: Any, *batch: Any) -> tuple[Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        grads = reduce_gradients(
            grads, axis_name, world_size=world_size, plan=plan, names=names, hook=hook
        )
        return lax.pmean(loss, axis_name), grads

    compiled: dict[int, Callable[..., tuple[Any, Any]]] = {}

    if mode == "pmap":

        def pmap_step(params: Any, *batch: Any) -> tuple[Any, Any]:
            _check_batch(batch, world_size)
            fn = compiled.get(len(batch))
            if fn is None:
                in_axes = (None, *([0] * len(batch)))
                fn = jax.pmap(local_step, axis_name, in_axes=in_axes, devices=devs)
                compiled[len(batch)] = fn
            shards = [jnp.reshape(a, (world_size, -1, *np.shape(a)[1:])) for a in batch]
            loss, grads = fn(params, *shards)
            return loss[0], jax.tree_util.tree_map(lambda g: g[0], grads)

        return pmap_step

    mesh = jax.sharding.Mesh(np.array(devs), (axis_name,))
    replicated = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P(axis_name))

    def shard_local(params: Any, *batch: Any) -> tuple[Any, Any]:
        # Differentiating a replicated input inside shard_map makes JAX insert its own psum
        # (the transpose of the implicit pvary); casting the parameters to device-varying
        # first keeps the reduction ours, bucket by bucket.
        params = jax.tree_util.tree_map(lambda p: lax.pcast(p, axis_name, to="varying"), params)
        return local_step(params, *batch)

    def specs(n: int) -> tuple[Any, ...]:
        return (P(), *([P(axis_name)] * n))

    def shard_map_step(params: Any, *batch: Any) -> tuple[Any, Any]:
        _check_batch(batch, world_size)
        fn = compiled.get(len(batch))
        if fn is None:
            fn = jax.jit(
                jax.shard_map(
                    shard_local, mesh=mesh, in_specs=specs(len(batch)), out_specs=(P(), P())
                )
            )
            compiled[len(batch)] = fn
        params = jax.device_put(params, replicated)
        batch = tuple(jax.device_put(a, split) for a in batch)
        return fn(params, *batch)

    return shard_map_step
