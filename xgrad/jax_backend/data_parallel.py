"""Data-parallel value-and-grad in JAX that reduces gradients bucket by bucket with a BucketPlan.

Three drivers run the same data-parallel step:

- ``"shard_map"`` (the default, :mod:`~xgrad.jax_backend.shard_map`): ``jax.shard_map``
  over a one-axis mesh, each device differentiating its shard and xgrad reducing the
  gradients bucket by bucket (:func:`~xgrad.jax_backend.reduce.reduce_gradients`, hooks
  included);
- ``"jit"`` (:mod:`~xgrad.jax_backend.jit_mode`): ``jax.jit`` of ``jax.value_and_grad``
  on the global batch sharded with a ``NamedSharding``: GSPMD places and combines the reductions itself (no plan, no hook),
  which shows what XLA's own combiner does to the numbers;
- ``"pmap"`` (:mod:`~xgrad.jax_backend.pmap`): the ``shard_map`` step under ``jax.pmap``
  (in maintenance mode since JAX 0.8; kept as a cross-check: it gives the ``shard_map``
  path's very bits).

Across processes (``jax.distributed.initialize``) the mesh spans every process's devices;
use ``shard_map`` or ``jit`` there (``pmap`` maps over one process's devices).

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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xgrad.buckets import BucketPlan
from xgrad.jax_backend import powersgd
from xgrad.jax_backend.batch import (
    check_batch,
    check_local_devices,
    check_local_rows,
    devices_for,
    normalize_in_axes,
    place,
    put_across,
)
from xgrad.jax_backend.jit_mode import compiled_text, jit_call
from xgrad.jax_backend.pmap import pmap_call
from xgrad.jax_backend.reduce import (
    HookSpec,
    powersgd_layouts,
    reduce_gradients,
    resolve_hook,
)
from xgrad.jax_backend.shard_map import shard_map_call
from xgrad.jax_backend.uneven import Rows, pad, split_rows, uneven_rows
from xgrad.jax_backend.uneven import value_and_grad as uneven_value_and_grad
from xgrad.powersgd import PowerSGD, Sampler

#: the ways of running the per-device step; ``shard_map`` first, ``pmap`` as a cross-check.
MODES: tuple[str, ...] = ("shard_map", "jit", "pmap")

#: ``loss_fn(params, *batch) -> scalar`` (or ``(scalar, aux)`` with ``has_aux=True``).
LossFn = Callable[..., Any]


class DataParallelStep:
    """``step(params, *batch) -> (value, grads)``: see :func:`data_parallel_value_and_grad`.

    With a PowerSGD hook the step also takes and returns the hook's state:
    ``value, grads, hook_state = step(params, *batch, hook_state=hook_state)``, the first
    ``hook_state`` from :meth:`init`. ``value`` is ``(loss, aux)`` with ``has_aux=True``.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        *,
        world_size: int,
        plan: BucketPlan | None,
        names: Sequence[str] | None,
        hook: str | PowerSGD | None,
        mode: str,
        axis_name: str,
        devices: list[Any],
        in_axes: Any,
        has_aux: bool,
        local_batch: bool,
    ) -> None:
        self.loss_fn = loss_fn
        self.world_size = world_size
        self.plan = plan
        self.names = None if names is None else list(names)
        self.hook = hook
        self.mode = mode
        self.axis_name = axis_name
        self.devices = devices
        self.in_axes = in_axes
        self.has_aux = has_aux
        self.local_batch = local_batch
        self.mesh = jax.sharding.Mesh(np.array(devices), (axis_name,))
        self._compiled: dict[Any, Callable[..., Any]] = {}

    @property
    def stateful(self) -> bool:
        """Whether the step takes and returns a ``hook_state`` (PowerSGD)."""
        return isinstance(self.hook, PowerSGD)

    def __repr__(self) -> str:
        return f"DataParallelStep(mode={self.mode!r}, world_size={self.world_size}, hook={self.hook!r})"

    def init(
        self,
        params: Any,
        *,
        qs: Mapping[int, Sequence[np.ndarray]] | None = None,
        sampler: Sampler | None = None,
    ) -> powersgd.PowerSGDCarry:
        """The hook's first state for ``params`` (PowerSGD: zero errors, first ``Q``).

        Args:
            params: the parameters (shapes and dtypes are what matter).
            qs: the first ``Q`` per bucket (see :func:`xgrad.jax_backend.powersgd.init`).
            sampler: draws the first ``Q`` (torch's replay: ``xgrad.torch_backend.powersgd
                .torch_sampler``); NumPy's by default.

        Raises:
            ValueError: the hook keeps no state.
        """
        if not isinstance(self.hook, PowerSGD):
            raise ValueError(f"hook={self.hook!r} keeps no state; init() is for PowerSGD")
        layouts, dtypes = powersgd_layouts(params, self.plan, self.names, self.hook)
        return powersgd.init(self.hook, layouts, dtypes, self.world_size, qs=qs, sampler=sampler)

    # -- the per-device program -------------------------------------------------------

    def _local(
        self,
        params: Any,
        batch: tuple[Any, ...],
        state: Any,
        stack_aux: bool = False,
        rows: Rows | None = None,
        axes: tuple[Any, ...] = (),
    ) -> tuple[Any, ...]:
        if rows is None:
            value, grads = jax.value_and_grad(self.loss_fn, has_aux=self.has_aux)(params, *batch)
        else:  # padded blocks: each device differentiates its own rows only
            value, grads = uneven_value_and_grad(
                self.loss_fn, self.has_aux, params, batch, axes, rows, self.axis_name
            )
        reduced = reduce_gradients(
            grads,
            self.axis_name,
            world_size=self.world_size,
            plan=self.plan,
            names=self.names,
            hook=self.hook,
            hook_state=state,
        )
        if self.has_aux:
            loss, aux = value
            if stack_aux:  # shard_map concatenates device blocks; pmap stacks on its own
                aux = jax.tree_util.tree_map(lambda a: jnp.expand_dims(a, 0), aux)
            value = (lax.pmean(loss, self.axis_name), aux)
        else:
            value = lax.pmean(value, self.axis_name)
        if self.stateful:
            grads, state = reduced
            return value, grads, state
        return value, reduced

    def _state_specs(self, state: powersgd.PowerSGDCarry, mapped: Any, whole: Any) -> Any:
        return powersgd.PowerSGDCarry(
            whole, tuple(mapped for _ in state.errors), tuple(whole for _ in state.qs), whole
        )

    def _value_spec(self, mapped: Any, whole: Any) -> Any:
        return (whole, mapped) if self.has_aux else whole

    # -- drivers ---------------------------------------------------------------------

    def __call__(self, params: Any, *batch: Any, hook_state: Any = None) -> tuple[Any, ...]:
        if not batch:
            raise ValueError("the step needs at least one batch argument after params")
        powersgd.check_hook_state(
            self.hook,
            hook_state,
            lambda config: powersgd_layouts(params, self.plan, self.names, config),
            self.world_size,
        )
        axes = normalize_in_axes(self.in_axes, len(batch))
        if self.mode == "pmap":
            return pmap_call(self, params, batch, axes, hook_state)
        rows = None
        if self.local_batch and jax.process_count() > 1:
            check_local_devices(self.devices)
            local = len([d for d in self.devices if d.process_index == jax.process_index()])
            check_batch(batch, axes, max(local, 1), f"this process's {local} device(s)")
            uneven_rows(batch, axes, max(local, 1))  # every split leaf as long
            check_local_rows(batch, axes)
        else:
            rows = split_rows(batch, axes, self.world_size, self.mode)
        if rows is not None:
            batch = pad(batch, axes, rows)
        replicated = NamedSharding(self.mesh, P())
        split = NamedSharding(self.mesh, P(self.axis_name))
        params = put_across(params, replicated)
        placed = place(batch, axes, split, replicated, self.local_batch)
        if self.mode == "jit":
            return jit_call(self, params, placed)
        return shard_map_call(self, params, placed, axes, hook_state, rows)

    def compiled_text(self, params: Any, *batch: Any) -> str:
        """The compiled program of ``mode="jit"`` for these arguments (XLA's HLO text)."""
        return compiled_text(self, params, batch)


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
    in_axes: Any = 0,
    has_aux: bool = False,
    local_batch: bool = False,
) -> DataParallelStep:
    """``step(params, *batch) -> (value, grads)`` over ``world_size`` devices, data-parallel.

    Every batch argument split by ``in_axes`` (all of them by default) is cut along the
    leading axis of each of its leaves into ``world_size`` equal contiguous shards (device
    ``r`` gets the ``r``-th); the others reach every device whole. Each device computes
    ``value_and_grad(loss_fn)`` on its shard, and the gradients are averaged with
    :func:`~xgrad.jax_backend.reduce.reduce_gradients` (bucketed when ``plan`` is given).
    The loss returned is the mean of the shard losses; the gradients are replicated.

    A batch ``world_size`` does not divide (``shard_map``, ``pmap``) splits as torch's
    ``tensor_split`` (10 rows over 4 devices: 3, 3, 2, 2), each device's gradient still
    counting 1/``world_size`` as PyTorch's DDP averages its ranks': the gradient of the
    mean of the shard losses, not of the whole batch's mean loss (see
    :mod:`~xgrad.jax_backend.uneven`). Every device needs at least one row.

    Wrap the whole training step (this and the optimizer's update) in ``jax.jit``.

    Args:
        loss_fn: ``loss_fn(params, *batch) -> scalar`` (``(scalar, aux)`` with ``has_aux``).
        world_size: number of devices (the first ``world_size`` of ``devices``).
        plan: bucket plan (see :func:`~xgrad.jax_backend.reduce.plan_for`); None reduces
            leaf by leaf. Not for ``mode="jit"``.
        names: parameter names in plan index order (see ``plan_order``).
        hook: communication hook: a name from ``HOOKS`` (``"powersgd"`` included) or a
            :class:`~xgrad.powersgd.PowerSGD`; PowerSGD makes the step stateful
            (``step.init(params)``, ``hook_state=``). Not for ``mode="jit"``.
        mode: ``"shard_map"``, ``"jit"`` (XLA reduces) or ``"pmap"`` (see ``MODES``).
        axis_name: the name of the data-parallel axis.
        devices: the devices to use (default ``jax.devices()``: every process's).
        in_axes: per batch argument, 0 (split) or None (every device gets it whole: RNG
            keys, step counts, learning rates, option dicts); one value for all, or a
            tuple (``pmap``'s, with a leading None for ``params``, is accepted too).
        has_aux: ``loss_fn`` returns ``(loss, aux)`` as for ``jax.value_and_grad``; the step
            returns ``((loss, aux), grads)`` with every device's ``aux`` stacked on a
            leading axis (``mode="jit"``: ``aux`` of the global batch).
        local_batch: each process passes only its own rows of split arguments (the
            multi-host convention; rows in process order make the global batch); by
            default every process passes the global batch.

    Raises:
        ValueError: bad mode, hook, world size (too few devices: the message says how to
            get more CPU devices), or a plan or hook with ``mode="jit"``.
        TypeError: a non-callable ``loss_fn`` or a hook of the wrong type.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r} is not callable")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    resolved = resolve_hook(hook)
    if mode == "jit" and (resolved is not None or plan is not None):
        raise ValueError(
            f"mode='jit' lets XLA place and combine the reductions; plan={plan!r} and "
            f"hook={hook!r} need mode='shard_map' (or 'pmap')"
        )
    if not isinstance(axis_name, str) or not axis_name:
        # An int reached JAX's psum as "does not accept integer axes", with no name.
        raise TypeError(f"axis_name={axis_name!r}: expected a non-empty str")
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux={has_aux!r}: expected a bool")
    devs = devices_for(world_size, devices)
    return DataParallelStep(
        loss_fn,
        world_size=world_size,
        plan=plan,
        names=names,
        hook=resolved,
        mode=mode,
        axis_name=axis_name,
        devices=devs,
        in_axes=in_axes,
        has_aux=has_aux,
        local_batch=bool(local_batch),
    )
