"""PowerSGD in JAX: xgrad's core PowerSGD traced per bucket, its state a pytree.

The arithmetic is :func:`xgrad.powersgd.compress` with ``lax.psum`` as the allreduce, so it
is torch's ``powerSGD_hook`` step for step. The state torch keeps in ``PowerSGDState``
(step count, error feedback per rank, warm-start ``Q``) is a :class:`PowerSGDCarry` that
the data-parallel step takes and returns, so the step stays a pure function that
``jax.jit`` compiles once: ``lax.cond`` chooses plain averaging before
``start_powerSGD_iter`` and PowerSGD after, inside the compiled program.

Fresh ``Q``: :func:`init` draws the first ones on the host as torch does (one seed per
bucket from ``RandomState(random_seed)``; a ``sampler`` replaying ``torch.randn`` gives
torch's very numbers). With warm start those are the only draws torch makes, so a whole
run can match torch's. Without warm start torch draws again every step; here the next
``Q`` come from ``jax.random`` inside the step (or the caller replaces
:attr:`PowerSGDCarry.qs` before a step, as the crosscheck does with torch's draws).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xgrad.powersgd import Layout, PowerSGD, Sampler, compress, layout
from xgrad.powersgd_hook import PowerSGDState

__all__ = ["PowerSGD", "PowerSGDCarry", "bucket_layouts", "init", "reduce_bucket"]


class PowerSGDCarry(NamedTuple):
    """PowerSGD's state between steps, as arrays (a pytree: jit, shard and save it).

    Attributes:
        iter: steps taken (int32 scalar), as ``PowerSGDState.iter``.
        errors: per bucket, every device's error-feedback memory, shape
            ``(world_size, bucket length)`` (empty tuple without error feedback).
        qs: per bucket, the ``Q`` the next PowerSGD step starts from (concatenated in
            layout order; not yet orthogonalised): last step's with warm start, else fresh.
        key: ``jax.random`` key data for fresh ``Q`` without warm start.
    """

    iter: Any
    errors: tuple[Any, ...]
    qs: tuple[Any, ...]
    key: Any


def bucket_layouts(shapes: Sequence[Sequence[tuple[int, ...]]], config: PowerSGD) -> list[Layout]:
    """One :class:`~xgrad.powersgd.Layout` per bucket of gradients of these shapes.

    Raises:
        ValueError: a scalar leaf (it has no matrix view; torch refuses it too).
    """
    out = []
    for b, bucket in enumerate(shapes):
        try:
            out.append(
                layout(bucket, config.matrix_approximation_rank, config.min_compression_rate)
            )
        except ValueError as err:
            raise ValueError(f"{err} (bucket {b})") from None
    return out


def init(
    config: PowerSGD,
    layouts: Sequence[Layout],
    dtypes: Sequence[Any],
    world_size: int,
    *,
    qs: Mapping[int, Sequence[np.ndarray]] | None = None,
    sampler: Sampler | None = None,
) -> PowerSGDCarry:
    """The state before the first step: zero errors, the first fresh ``Q`` of every bucket.

    Args:
        config: the hyperparameters.
        layouts: per bucket (see :func:`bucket_layouts`).
        dtypes: per bucket, its gradients' dtype.
        world_size: devices the step runs on.
        qs: bucket -> its first ``Q`` blocks ``(m, rank)`` in layout order (e.g. torch's
            draws); None draws them as torch does, from ``sampler`` (NumPy's by default).
        sampler: see :data:`xgrad.powersgd.Sampler`.

    Raises:
        ValueError: given ``qs`` of the wrong shapes (both shown).
    """
    host = PowerSGDState(config, sampler=sampler)
    first = []
    for b, (lay, dtype) in enumerate(zip(layouts, dtypes, strict=True)):
        name = jnp.dtype(dtype).name
        if qs is None:
            drawn = host.fresh_q(lay, name)
        else:
            given = [np.asarray(q) for q in qs.get(b, ())]
            if [q.shape for q in given] != list(lay.q_shapes):
                raise ValueError(
                    f"PowerSGD qs for bucket {b} have shapes {[q.shape for q in given]}, "
                    f"expected {list(lay.q_shapes)}"
                )
            drawn = np.concatenate([q.ravel() for q in given]) if given else np.zeros(0)
        first.append(jnp.asarray(drawn, dtype=dtype))
    errors: tuple[Any, ...] = ()
    if config.use_error_feedback:
        errors = tuple(
            jnp.zeros((world_size, lay.length), dtype=dtype)
            for lay, dtype in zip(layouts, dtypes, strict=True)
        )
    key = jax.random.key_data(jax.random.key(config.random_seed))
    return PowerSGDCarry(jnp.zeros((), jnp.int32), errors, tuple(first), key)


def reduce_bucket(
    flat: Any,
    bucket: int,
    lay: Layout,
    config: PowerSGD,
    carry: PowerSGDCarry,
    axis_name: str,
    world_size: int,
) -> tuple[Any, Any, Any]:
    """This device's share of one bucket: ``(reduced flat bucket, new error, next Q)``.

    Call inside pmap/shard_map with ``axis_name`` bound; ``carry.errors[bucket]`` is this
    device's own row (shape ``(length,)``).
    """
    error = carry.errors[bucket] if config.use_error_feedback else None
    q = carry.qs[bucket]

    def psum(x: Any) -> Any:
        return lax.psum(x, axis_name)

    def plain(flat: Any, error: Any, q: Any) -> tuple[Any, Any, Any]:
        # Before start_powerSGD_iter: torch's allreduce, divide first, then sum.
        return psum(flat / world_size), error, q

    def powersgd(flat: Any, error: Any, q: Any) -> tuple[Any, Any, Any]:
        if config.use_error_feedback:
            flat = flat + error
        out, q_reduced = compress(flat, lay, q, psum, world_size, config.orthogonalization_epsilon)
        if config.use_error_feedback:
            error = flat - out
        if config.warm_start:
            q_next = q_reduced
        else:
            key = jax.random.fold_in(jax.random.wrap_key_data(carry.key), carry.iter)
            q_next = jax.random.normal(jax.random.fold_in(key, bucket), q.shape, q.dtype)
        return out, error, q_next

    if config.start_powerSGD_iter == 0:
        return powersgd(flat, error, q)
    return lax.cond(carry.iter < config.start_powerSGD_iter, plain, powersgd, flat, error, q)  # type: ignore[no-any-return]
