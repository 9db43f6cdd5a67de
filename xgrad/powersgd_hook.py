"""PowerSGD's stateful hook for xgrad's reducers: torch's ``PowerSGDState`` on any array library.

The state (step count, error feedback per bucket, warm-start ``Q``, the seed generator) is
kept on the host and mutated bucket by bucket, as PyTorch's hook keeps it; the arithmetic
is :func:`xgrad.powersgd.compress`. The float64 truth of the crosscheck runs this state on
NumPy ranks stacked on one axis; :func:`powersgd_hook` runs it over a ``Comm`` on real
ranks (NumPy or torch tensors). JAX carries the same state as arrays instead
(``xgrad.jax_backend.powersgd``) and uses :meth:`PowerSGDState.fresh_q` for its first draws.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from xgrad.backend import Comm, Work
from xgrad.buckets import BucketPlan
from xgrad.powersgd import (
    STATELESS,
    AllReduce,
    Layout,
    PowerSGD,
    Sampler,
    array_namespace,
    compress,
    layout,
    numpy_sampler,
)

__all__ = ["PowerSGDState", "fresh_draws", "initial_qs", "powersgd_hook"]


class PowerSGDState:
    """The hook's memory across steps, as ``PowerSGDState`` keeps it (host-side, mutable).

    Attributes:
        config: the :class:`PowerSGD` hyperparameters.
        iter: steps completed (counted when the last bucket of a step is reduced).
        error_dict: bucket index -> what compression lost last step (error feedback).
        q_memory_dict: bucket index -> last step's reduced ``Q`` (warm start).
        rng: ``RandomState(random_seed)``: one seed per bucket needing fresh ``Q``.
        sampler: draws the fresh ``Q`` from a seed (:func:`numpy_sampler` by default).
    """

    def __init__(self, config: PowerSGD | None = None, *, sampler: Sampler | None = None) -> None:
        self.config = PowerSGD() if config is None else config
        self.sampler: Sampler = numpy_sampler if sampler is None else sampler
        self.iter = 0
        self.error_dict: dict[int, Any] = {}
        self.q_memory_dict: dict[int, Any] = {}
        self.rng = np.random.RandomState(self.config.random_seed)

    def fresh_q(self, lay: Layout, dtype: str) -> np.ndarray:
        """Fresh ``Q`` for a bucket (concatenated), consuming one seed as torch does."""
        seed = int(self.rng.randint(1_000_000_000))
        blocks = self.sampler(seed, lay.q_shapes, dtype)
        if not blocks:
            return np.zeros(0)
        return np.concatenate([np.ravel(b) for b in blocks])

    def reduce(
        self,
        flat: Any,
        lay: Layout,
        bucket_index: int,
        is_last: bool,
        allreduce: AllReduce,
        world_size: int,
    ) -> Any:
        """One bucket of one step through the stateful hook (blocking): the reduced bucket."""
        cfg = self.config
        xp = array_namespace(flat)
        if self.iter < cfg.start_powerSGD_iter:
            out = allreduce(flat / world_size)
        else:
            if cfg.use_error_feedback:
                if bucket_index in self.error_dict:
                    flat = flat + self.error_dict[bucket_index]
                kept = flat
            if cfg.warm_start and bucket_index in self.q_memory_dict:
                q = self.q_memory_dict[bucket_index]
            else:
                drawn = self.fresh_q(lay, _dtype_name(flat.dtype))
                q = xp.asarray(drawn, dtype=flat.dtype, device=_device(flat))
            out, q = compress(flat, lay, q, allreduce, world_size, cfg.orthogonalization_epsilon)
            if cfg.use_error_feedback:
                self.error_dict[bucket_index] = kept - out
            if cfg.warm_start:
                self.q_memory_dict[bucket_index] = q
        if is_last:
            self.iter += 1
        return out


def _dtype_name(dtype: Any) -> str:
    text = str(dtype)
    return text.rsplit(".", 1)[-1]


def _device(x: Any) -> Any:
    try:
        from array_api_compat import device
    except ImportError:  # pragma: no cover - array_namespace already needed it
        return None
    return device(x)


class _Done:
    """A reduction already finished (the stateful hook runs its collectives in order)."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def wait(self) -> Any:
        return self._value


def powersgd_hook(comm: Comm, state: PowerSGDState | PowerSGD | None = None) -> Any:
    """PowerSGD as an xgrad communication hook over ``comm`` (NumPy ranks, torch tensors).

    Its three collectives per bucket run one after another before the hook returns, so
    every rank issues them in the same order whatever the reducer overlaps.

    Args:
        comm: the ranks to reduce over.
        state: a :class:`PowerSGDState` (kept by the caller, e.g. to read ``iter``), a
            :class:`PowerSGD` configuration (a fresh state), or None (PyTorch's defaults).
    """
    memory = state if isinstance(state, PowerSGDState) else PowerSGDState(state)

    def allreduce(buffer: Any) -> Any:
        return comm.allreduce(buffer).wait()

    def hook(bucket: Any) -> Work:
        grads = bucket.gradients()
        lay = layout(
            [tuple(g.shape) for g in grads],
            memory.config.matrix_approximation_rank,
            memory.config.min_compression_rate,
        )
        out = memory.reduce(
            bucket.buffer(), lay, bucket.index(), bucket.is_last(), allreduce, comm.size
        )
        return _Done(out)

    hook.state = memory  # type: ignore[attr-defined]
    return hook


def fresh_draws(
    bucket_shapes: Sequence[Sequence[tuple[int, ...]]],
    config: PowerSGD,
    dtype: str,
    sampler: Sampler | None = None,
) -> Iterator[dict[int, list[np.ndarray]]]:
    """Every fresh ``Q`` the hook draws, in order: one dict (bucket -> blocks) per draw round.

    Torch draws for every bucket at every PowerSGD step without warm start, and only at
    the first one with it; buckets in launch order, each consuming one seed whether it
    compresses anything or not. Replaying this with torch's sampler gives torch's numbers
    to a backend that computes elsewhere (JAX).
    """
    state = PowerSGDState(config, sampler=sampler)
    layouts = [
        layout(shapes, config.matrix_approximation_rank, config.min_compression_rate)
        for shapes in bucket_shapes
    ]
    while True:
        yield {
            b: state.sampler(int(state.rng.randint(1_000_000_000)), lay.q_shapes, dtype)
            for b, lay in enumerate(layouts)
        }


def initial_qs(
    weights: Mapping[str, np.ndarray],
    plan: BucketPlan,
    steps: int,
    seed: int = 0,
    config: PowerSGD | None = None,
    sampler: Sampler | None = None,
) -> dict[int, list[np.ndarray]]:
    """The fresh ``Q`` the hook draws at its ``steps``-th draw round (see :func:`fresh_draws`).

    With a framework's sampler (``xgrad.backend.find_sampler()``: torch's, as
    ``powerSGD_hook`` draws) another backend or the float64 model starts from its numbers.

    Returns:
        bucket index -> one ``(m, rank)`` float64 array per compressed gradient, in the
        bucket's :func:`~xgrad.powersgd.layout` order.
    """
    cfg = config or dataclasses.replace(STATELESS, random_seed=seed)
    names = list(weights)
    shapes = [[weights[names[i]].shape for i in bucket] for bucket in plan.buckets]
    dtype = np.dtype(next(iter(weights.values())).dtype).name
    draws = fresh_draws(shapes, cfg, dtype, sampler)
    return next(itertools.islice(draws, steps - 1, None))
