"""Which step arguments are split across devices, their checks, and placing them on a mesh.

A data-parallel step takes ``params`` (replicated) and batch arguments. Each batch argument
is a pytree (an array, a dict of arrays, ...) that is either *split* along the leading
axis of every leaf into ``world_size`` contiguous shards (``in_axes`` entry ``0``) or given
whole to every device (``None``: an RNG key, a step count, a learning rate, options), as
``jax.pmap``'s and ``jax.vmap``'s ``in_axes`` say it.

Across processes (``jax.distributed.initialize``), a split argument is either the global
batch on every process (each keeps its devices' shards) or, with ``local_batch=True``, the
multi-host convention: each process passes only its own rows, which
``jax.make_array_from_process_local_data`` assembles into one global array.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

#: an ``in_axes`` entry: 0 (split along the leading axis) or None (every device gets it whole).
Axis = int | None


def normalize_in_axes(in_axes: Any, count: int) -> tuple[Axis, ...]:
    """One ``0``/``None`` per batch argument, from what the caller gave.

    ``in_axes`` is 0 or None for every argument, or a sequence with one entry per batch
    argument; a sequence one longer whose first entry is None also counts (``pmap``'s
    convention includes ``params``, which are always replicated here).

    Raises:
        ValueError: a wrong length or an entry other than 0 or None (both shown).
    """
    if in_axes is None or (isinstance(in_axes, int) and not isinstance(in_axes, bool)):
        axes: tuple[Any, ...] = (in_axes,) * count
    elif isinstance(in_axes, list | tuple):
        axes = tuple(in_axes)
        if len(axes) == count + 1 and axes[0] is None:
            axes = axes[1:]
        if len(axes) != count:
            raise ValueError(
                f"in_axes={in_axes!r} has {len(in_axes)} entries for {count} batch "
                "argument(s): give one per argument after params (0 splits it, None replicates)"
            )
    else:
        raise TypeError(f"in_axes={in_axes!r}: expected 0, None or a tuple of them")
    for i, axis in enumerate(axes):
        if axis is not None and (isinstance(axis, bool) or axis != 0):
            raise ValueError(
                f"in_axes[{i}]={axis!r}: only 0 (split along the leading axis) or None "
                "(every device gets the argument whole) are supported"
            )
    return axes


def _path(path: Any) -> str:
    return jax.tree_util.keystr(path) if path else ""


def check_batch(
    batch: Sequence[Any], axes: Sequence[Axis], parts: int, what: str, *, uneven: bool = False
) -> None:
    """Every split leaf has a leading dimension of at least ``parts`` rows that divides
    into ``parts`` equal shards (or, with ``uneven``, into unequal ones:
    :mod:`~xgrad.jax_backend.uneven`).

    Raises:
        ValueError: an empty pytree, a scalar, a typed PRNG key, fewer rows than
            ``parts`` (an empty shard) or, without ``uneven``, an uneven leading
            dimension, naming the argument and the leaf.
    """
    for i, (arg, axis) in enumerate(zip(batch, axes, strict=True)):
        if axis is None:
            continue
        leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
        if not leaves:
            raise ValueError(f"batch argument {i} is an empty pytree ({arg!r}): nothing to split")
        for path, leaf in leaves:
            where = f"batch argument {i}{_path(path)}"
            dtype = getattr(leaf, "dtype", None)
            if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
                raise ValueError(
                    f"{where} is a PRNG key: give it to every device whole with in_axes "
                    f"None for argument {i} (in_axes=(..., None, ...))"
                )
            shape = np.shape(leaf)
            if not shape:
                raise ValueError(
                    f"{where} is a scalar, which cannot be split over {what}: pass "
                    f"in_axes None for argument {i} to give it to every device"
                )
            if shape[0] < parts:
                raise ValueError(
                    f"{where} has {shape[0]} rows, fewer than {parts} ({what}): every device "
                    "needs at least one row"
                )
            if shape[0] % parts and not uneven:
                raise ValueError(
                    f"{where} has leading dimension {shape[0]}, which does not split "
                    f"evenly over {what}"
                )


def leaf_rows(batch: Sequence[Any], axes: Sequence[Axis]) -> list[tuple[str, int]]:
    """Each split leaf (as the messages name it) and its leading dimension, in order."""
    return [
        (f"batch argument {i}{_path(path)}", int(np.shape(leaf)[0]))
        for i, (arg, axis) in enumerate(zip(batch, axes, strict=True))
        if axis is not None
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]
    ]


def check_local_rows(batch: Sequence[Any], axes: Sequence[Axis]) -> None:
    """With ``local_batch=True`` over several processes: every process passes the same
    number of rows in each split leaf (one small all-gather of the counts).

    Each process's rows fill its own devices' shards; with counts that differ, the
    processes assembled different global arrays and the step returned wrong numbers
    without an error (6 and 10 rows on two processes: gradients 18% off).

    Raises:
        ValueError: on every process alike, naming the leaf and each process's rows.
    """
    if jax.process_count() == 1:
        return
    found = [
        (f"batch argument {i}{_path(path)}", np.shape(leaf)[0])
        for i, (arg, axis) in enumerate(zip(batch, axes, strict=True))
        if axis is not None
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]
        if not isinstance(leaf, jax.core.Tracer)
        and not (isinstance(leaf, jax.Array) and not leaf.is_fully_addressable)
    ]
    if not found:
        return
    from jax.experimental import multihost_utils

    counts = np.asarray(multihost_utils.process_allgather(np.asarray([n for _, n in found])))
    for k, (where, _) in enumerate(found):
        column = [int(c) for c in counts.reshape(jax.process_count(), -1)[:, k]]
        if len(set(column)) > 1:
            each = ", ".join(f"{n} rows on process {p}" for p, n in enumerate(column))
            raise ValueError(
                f"{where} has {each}: with local_batch=True every process passes the same "
                "number of rows (its share of the global batch)"
            )


def check_local_devices(devices: Sequence[Any]) -> None:
    """With ``local_batch=True`` over several processes: every process holds the same
    number of the step's devices (at least one).

    Each process's rows fill its own devices' shards. A process with none of them (a
    ``world_size`` smaller than every device) had its rows dropped: process 0 returned the
    gradient of its own rows alone, without an error, and process 1 "generator raised
    StopIteration".

    Raises:
        ValueError: on every process alike (the devices are the same list everywhere),
            naming each process's count.
    """
    count = jax.process_count()
    if count == 1:
        return
    held = [sum(d.process_index == p for d in devices) for p in range(count)]
    if min(held) == 0 or len(set(held)) > 1:
        each = ", ".join(f"{n} on process {p}" for p, n in enumerate(held))
        raise ValueError(
            f"local_batch=True splits each process's rows over its own devices of the step, "
            f"so every process needs as many of them; the step's {len(devices)} devices are "
            f"{each} (give a world_size or devices= with as many devices of every process)"
        )


def _portable(leaf: Any) -> Any:
    """A host value as ``device_put`` onto several processes' devices takes it.

    With JAX's default 32-bit mode, ``device_put`` of a float64 NumPy array or a Python
    float that float32 cannot hold exactly (``np.random.randn`` data, ``0.1``) onto
    another process's devices fails JAX's own same-on-every-process check ("... is not
    the same on each process") although every process passed the same value; converted
    by ``jnp.asarray`` first (the dtype ``device_put`` would give it, weak types kept),
    it passes.
    """
    if isinstance(leaf, jax.Array | jax.core.Tracer):
        return leaf
    import jax.numpy as jnp

    return jnp.asarray(leaf)


def put_across(tree: Any, sharding: NamedSharding) -> Any:
    """``jax.device_put(tree, sharding)`` that also works across processes for host
    values (see :func:`_portable`) and typed PRNG keys (``jax.random.key``: JAX refuses
    to put a key array on devices other processes hold; its key data goes instead)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def put(leaf: Any) -> Any:
        leaf = _portable(leaf)
        dtype = getattr(leaf, "dtype", None)
        if (
            dtype is not None
            and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
            and not isinstance(leaf, jax.core.Tracer)
            and leaf.is_fully_addressable
        ):
            data = jax.device_put(jax.random.key_data(leaf), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
        return jax.device_put(leaf, sharding)

    return jax.tree_util.tree_map(put, tree)


def place(
    batch: Sequence[Any],
    axes: Sequence[Axis],
    split: NamedSharding,
    replicated: NamedSharding,
    local_batch: bool,
) -> tuple[Any, ...]:
    """``batch`` as arrays on the mesh: split arguments sharded, the others replicated.

    Global ``jax.Array``s already spanning several processes are used as they are.

    Raises:
        ValueError: ``local_batch=True`` inside a trace (the rows must be concrete).
    """

    def put(leaf: Any, axis: Axis) -> Any:
        traced = isinstance(leaf, jax.core.Tracer)
        if not traced and isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return leaf
        if axis is None:
            return put_across(leaf, replicated)
        if not local_batch:
            return put_across(leaf, split)
        if traced:
            raise ValueError(
                "local_batch=True assembles each process's rows into a global array, which "
                "needs concrete arrays: call the step outside jax.jit (it compiles itself) "
                "or pass global jax.Arrays"
            )
        return jax.make_array_from_process_local_data(split, np.asarray(leaf))

    return tuple(
        jax.tree_util.tree_map(lambda leaf, a=axis: put(leaf, a), arg)
        for arg, axis in zip(batch, axes, strict=True)
    )


def devices_for(world_size: int, devices: Sequence[Any] | None) -> list[Any]:
    """The first ``world_size`` devices (of every process, by default).

    Raises:
        ValueError: a world size that is not a positive int, or too few devices (the
            message says how to get more CPU devices).
    """
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
