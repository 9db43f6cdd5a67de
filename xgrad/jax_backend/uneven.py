"""Batches the device count does not divide, split as torch's ``tensor_split`` splits them.

10 rows over 4 devices are 3, 3, 2, 2: the first ``n % w`` devices get one row more, as
both pipelines split a batch into microbatches. ``shard_map`` and ``pmap`` give every
device a block of one shape, so each split leaf is laid out as ``w`` blocks of
``q + 1`` rows (``q = n // w``): a device's own rows, then, where it has only ``q``, one
copy of its last row. The copy never reaches the loss: each device differentiates its own
rows alone (a ``lax.cond`` on its index picks the ``q + 1``-row or the ``q``-row program;
both are compiled, one runs), so the numbers are the unpadded shards' for any
``loss_fn``, not only for one that a zero-weighted mask row leaves unchanged.

Each device's gradient then counts 1/w whatever its rows, as PyTorch's DDP averages its
ranks' gradients (each of its own rows' mean loss, allreduced and divided by the world
size) and as the pipelines count each microbatch 1/m: the step's gradient is that of the
mean of the w shard losses, not of the whole batch's mean loss (a row of a 2-row shard
weighs 1/8, one of a 3-row shard 1/12). The even batch (w divides n) takes none of this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xgrad.jax_backend.batch import Axis, check_batch, leaf_rows


class Rows(NamedTuple):
    """``total`` rows over ``parts`` devices, as ``tensor_split`` splits them."""

    total: int
    parts: int

    @property
    def fewer(self) -> int:
        """The rows of the devices with fewer (``q``; the others have ``q + 1``)."""
        return self.total // self.parts

    @property
    def more(self) -> int:
        """How many devices, the first ones, have ``q + 1`` rows."""
        return self.total % self.parts

    def sizes(self) -> list[int]:
        """Each device's rows: ``[3, 3, 2, 2]`` for 10 over 4."""
        return [self.fewer + (d < self.more) for d in range(self.parts)]

    def layout(self) -> np.ndarray:
        """The row of the batch at each row of the padded layout (``parts`` blocks of
        ``q + 1``), a device's last row again where it has only ``q``."""
        starts = np.cumsum([0, *self.sizes()[:-1]])
        last = np.arange(self.fewer + 1)
        return np.concatenate(
            [
                start + np.minimum(last, size - 1)
                for start, size in zip(starts, self.sizes(), strict=True)
            ]
        )

    def __str__(self) -> str:
        return f"{self.total} rows over {self.parts} devices ({', '.join(map(str, self.sizes()))})"


def uneven_rows(batch: Sequence[Any], axes: Sequence[Axis], parts: int) -> Rows | None:
    """None where ``parts`` divides every split leaf (the even step); else their split.

    Every split leaf must have the same rows, even where ``parts`` divides each: device
    ``r`` pairs its share of one leaf with its share of the other, which are the same
    rows of the batch only when the leaves are as long. Leaves of 8 and 2 rows over 2
    devices paired rows 0-3 of one with row 0 of the other, and a loss that broadcasts
    (``out - y``) returned a number the whole batch's loss refuses to compute.

    Raises:
        ValueError: split leaves of different lengths (naming two of them).
    """
    found = leaf_rows(batch, axes)
    if not found:  # nothing split: every argument reaches every device whole
        return None
    (first, n), *rest = found
    for where, other in rest:
        if other != n:
            raise ValueError(
                f"{first} has {n} rows and {where} {other}: every split leaf needs the same "
                f"rows, since each of the {parts} devices takes the same rows of each (give "
                "a leaf that is not one row per example whole, with in_axes None)"
            )
    if n % parts == 0:
        return None
    return Rows(n, parts)


def split_rows(
    batch: Sequence[Any], axes: Sequence[Axis], world_size: int, mode: str
) -> Rows | None:
    """The split arguments checked: None for an even batch, else how it splits.

    Raises:
        ValueError: what :func:`~xgrad.jax_backend.batch.check_batch` refuses, fewer rows
            than devices included, or an uneven batch under ``mode="jit"``.
    """
    check_batch(batch, axes, world_size, f"world_size={world_size}", uneven=True)
    rows = uneven_rows(batch, axes, world_size)
    if rows is not None and mode == "jit":
        raise ValueError(
            f"mode='jit' differentiates the whole batch's loss on a batch sharded evenly "
            f"over the devices, so it cannot take {rows}: use mode='shard_map' or 'pmap' "
            "(each device's gradient counting 1/world_size, as DDP's)"
        )
    return rows


def pad(batch: Sequence[Any], axes: Sequence[Axis], rows: Rows) -> tuple[Any, ...]:
    """Every split leaf in the padded layout (see :meth:`Rows.layout`); host arrays stay on
    the host, to be placed as an even batch would be."""
    index = rows.layout()

    def take(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array | jax.core.Tracer):
            return jnp.take(leaf, index, axis=0)
        return np.asarray(leaf)[index]

    return tuple(
        arg if axis is None else jax.tree_util.tree_map(take, arg)
        for arg, axis in zip(batch, axes, strict=True)
    )


def value_and_grad(
    loss_fn: Callable[..., Any],
    has_aux: bool,
    params: Any,
    batch: Sequence[Any],
    axes: Sequence[Axis],
    rows: Rows,
    axis_name: Any,
) -> tuple[Any, Any]:
    """This device's ``value_and_grad(loss_fn)`` on its own rows of its padded block.

    Raises:
        ValueError: ``has_aux`` with an ``aux`` whose shapes follow the rows: the devices
            with ``q + 1`` rows and those with ``q`` would return differing ones.
    """

    def on(count: int) -> Callable[[], Any]:
        def run() -> Any:
            own = [
                arg if axis is None else jax.tree_util.tree_map(lambda a: a[:count], arg)
                for arg, axis in zip(batch, axes, strict=True)
            ]
            return jax.value_and_grad(loss_fn, has_aux=has_aux)(params, *own)

        return run

    more, fewer = on(rows.fewer + 1), on(rows.fewer)
    if has_aux:
        shapes = [
            jax.tree_util.tree_map(lambda s: (s.shape, s.dtype), jax.eval_shape(f)[0][1])
            for f in (more, fewer)
        ]
        if shapes[0] != shapes[1]:
            raise ValueError(
                f"has_aux=True on {rows}: aux is {shapes[0]} on {rows.fewer + 1} rows and "
                f"{shapes[1]} on {rows.fewer}; every device returns one aux of one shape, "
                "so with an uneven batch its shapes may not follow the rows"
            )
    return lax.cond(lax.axis_index(axis_name) < rows.more, more, fewer)  # type: ignore[no-any-return]
