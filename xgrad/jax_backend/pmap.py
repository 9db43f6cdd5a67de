"""The ``pmap`` driver of the data-parallel step (in maintenance mode in JAX; a cross-check).

It runs the very per-device program of the ``shard_map`` driver under ``jax.pmap``, with
the batch reshaped to a leading device axis, and gives the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from xgrad.jax_backend import powersgd
from xgrad.jax_backend.uneven import pad, split_rows

if TYPE_CHECKING:
    from xgrad.jax_backend.data_parallel import DataParallelStep


def pmap_call(
    step: DataParallelStep, params: Any, batch: tuple[Any, ...], axes: tuple[Any, ...], state: Any
) -> tuple[Any, ...]:
    """``step``'s call under ``jax.pmap``: ``(value, grads[, hook_state])`` as shard_map's."""
    if jax.process_count() > 1:
        raise ValueError(
            "mode='pmap' maps over this process's devices only; across processes use "
            "mode='shard_map' or mode='jit'"
        )
    rows = split_rows(batch, axes, step.world_size, step.mode)
    if rows is not None:
        batch = pad(batch, axes, rows)
    devices = step.devices or jax.local_devices()[: step.world_size]
    state = _placed(state, devices, step.axis_name)
    key = ("pmap", axes, jax.tree_util.tree_structure(state), rows)
    fn = step._compiled.get(key)
    if fn is None:
        state_axes = None if state is None else step._state_specs(state, 0, None)

        def body(params: Any, batch: tuple[Any, ...], *rest: Any) -> tuple[Any, ...]:
            return step._local(params, batch, rest[0] if rest else None, rows=rows, axes=axes)

        fn = jax.pmap(
            body,
            step.axis_name,
            in_axes=(None, axes) if state is None else (None, axes, state_axes),
            devices=step.devices,
        )
        step._compiled[key] = fn
    ws = step.world_size
    shards = tuple(
        arg
        if axis is None
        else jax.tree_util.tree_map(lambda a: jnp.reshape(a, (ws, -1, *np.shape(a)[1:])), arg)
        for arg, axis in zip(batch, axes, strict=True)
    )
    out = fn(params, shards) if state is None else fn(params, shards, state)

    def first(tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda a: a[0], tree)

    value = (first(out[0][0]), out[0][1]) if step.has_aux else first(out[0])
    result: tuple[Any, ...] = (value, first(out[1]))
    if state is not None:
        new = out[2]
        result = (
            *result,
            powersgd.PowerSGDCarry(new.iter[0], new.errors, first(new.qs), new.key[0]),
        )
    return result


def _placed(state: Any, devices: Sequence[Any], axis: Any) -> Any:
    """``state`` placed as the step returns it: its replicated parts (iteration, ``Q``s,
    key) committed to the first device, each error-feedback memory one row per device.
    The initial state's arrays were placed apart from the step's outputs, and the second
    call compiled the step again (half a second a step in the crosscheck's timing of
    PowerSGD under pmap, which warms up with one step). Traced by an outer ``jax.jit``
    (the training step wrapped whole, as the step's docstring asks), it is left as it
    is: a tracer has no placement to read, and where its values lie is that jit's."""
    if state is None or any(
        isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(state)
    ):
        return state
    iter_, qs, key = jax.device_put((state.iter, state.qs, state.key), devices[0])
    rows = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(list(devices)), (axis,)), jax.sharding.PartitionSpec(axis)
    )
    errors = tuple(e if e.sharding == rows else jax.device_put(e, rows) for e in state.errors)
    return state._replace(iter=iter_, errors=errors, qs=qs, key=key)
