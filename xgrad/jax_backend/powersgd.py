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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xgrad.powersgd import Layout, PowerSGD, Sampler, compress, layout
from xgrad.powersgd_hook import PowerSGDState

__all__ = ["PowerSGD", "PowerSGDCarry", "bucket_layouts", "check_carry", "init", "reduce_bucket"]


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


def check_carry(
    carry: Any,
    config: PowerSGD,
    layouts: Sequence[Layout],
    dtypes: Sequence[Any],
    world_size: int,
) -> None:
    """``carry`` is the state :func:`init` makes for these buckets, world size and settings.

    A state made for another step went in without a word or failed deep inside the trace:
    a 4-device step's given to a 2-device ``shard_map`` step had its error rows split in
    two blocks, each device taking the first row of its block (rows 0 and 2 of 4) without
    an error; under ``pmap`` it stopped at "cannot select an axis to squeeze out"; one of
    rank 2 at "cond branches must have equal output types"; one of another plan or other
    parameters at "add got incompatible shapes", with no bucket named.

    Raises:
        TypeError: not a :class:`PowerSGDCarry`.
        ValueError: naming the first part whose count, shape or dtype differs, and both.
    """
    if not isinstance(carry, PowerSGDCarry):
        raise TypeError(
            f"hook_state={type(carry).__name__}: expected the PowerSGDCarry that step.init(params) "
            "makes and the step returns"
        )
    errors = (
        [((world_size, lay.length), dtype) for lay, dtype in zip(layouts, dtypes, strict=True)]
        if config.use_error_feedback
        else []
    )
    qs = [((lay.q_size,), dtype) for lay, dtype in zip(layouts, dtypes, strict=True)]
    for part, got, want in (("errors", carry.errors, errors), ("qs", carry.qs, qs)):
        if len(got) != len(want):
            raise ValueError(
                f"hook_state.{part} has {len(got)} entries but this step has {len(want)} "
                f"(one per bucket{', none without error feedback' if part == 'errors' else ''}): "
                "was the state made by step.init for another plan or hook?"
            )
        for b, (array, (shape, dtype)) in enumerate(zip(got, want, strict=True)):
            found = (tuple(np.shape(array)), jnp.result_type(array))
            if found != (shape, jnp.dtype(dtype)):
                raise ValueError(
                    f"hook_state.{part}[{b}] has shape {found[0]} and dtype {found[1]}, but "
                    f"bucket {b} of this step needs {shape} and {jnp.dtype(dtype)} (world_size="
                    f"{world_size}, matrix_approximation_rank={config.matrix_approximation_rank}):"
                    " make the state with this step's init(params)"
                )


def check_hook_state(
    hook: Any,
    state: Any,
    layouts: Callable[[PowerSGD], tuple[list[Layout], list[Any]]],
    world_size: int,
) -> None:
    """A data-parallel step's ``hook_state=``: a fitting :class:`PowerSGDCarry` with a
    PowerSGD ``hook`` (``layouts(hook)``: its buckets' layouts and dtypes), None without.

    Raises:
        ValueError: a state missing or given where none is kept, or one that does not
            fit (see :func:`check_carry`).
        TypeError: not a :class:`PowerSGDCarry`.
    """
    if not isinstance(hook, PowerSGD):
        if state is not None:
            raise ValueError(f"hook={hook!r} keeps no state; drop hook_state=")
        return
    if state is None:
        raise ValueError(
            "hook=PowerSGD keeps state: call step(params, *batch, hook_state=state) "
            "with state = step.init(params) first, and pass the state it returns on"
        )
    check_carry(state, hook, *layouts(hook), world_size)


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
