"""PowerSGD per bucket in JAX, with the arithmetic of torch's ``powerSGD_hook``.

For each bucket, as torch does (no error feedback, no warm start): every gradient is viewed
as a matrix ``(shape[0], -1)``; those worth compressing at the given rank (``(n + m) * r *
min_compression_rate < n * m``) are approximated, the others are summed and divided by the
world size. For a compressed ``M`` (this device's gradient) and an initial ``Q`` (random,
orthogonalized): ``P = M Q`` is summed over devices and orthogonalized, ``Q = M^T P`` is
summed and divided by the world size, and the result is ``P Q^T``. All ``P`` of a bucket
travel in one collective and all ``Q`` in another, ordered like torch's (grouped by matrix
shape, in order of first appearance).

Torch draws new random ``Q`` at every step from its own generator; here the initial ``Q``
are inputs of the compiled step (:attr:`PowerSGD.qs`, or a seeded default), so the same
step can be replayed with torch's draws (``xgrad.crosscheck.torch_powersgd_qs``) and
compared number for number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from xgrad.crosscheck import powersgd_layout


@dataclass(frozen=True)
class PowerSGD:
    """A PowerSGD hook for :func:`~xgrad.jax_backend.data_parallel.reduce_gradients`.

    Attributes:
        rank: the approximation rank (torch's ``matrix_approximation_rank``).
        min_compression_rate: compress a matrix only when it shrinks by more than this.
        qs: bucket index -> its initial ``Q`` matrices ``(m, rank)``, in layout order (not
            yet orthogonalized); None draws them from ``seed``.
        seed: seeds the default ``Q`` (a normal draw per bucket).
    """

    rank: int = 1
    min_compression_rate: float = 2.0
    qs: Mapping[int, Sequence[np.ndarray]] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"PowerSGD rank={self.rank!r} must be a positive integer")

    def initial_qs(self, bucket: int, shapes: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """The initial ``Q`` of bucket ``bucket`` for compressed matrices of ``shapes``."""
        wanted = [(m, min(n, m, self.rank)) for n, m in shapes]
        if self.qs is None:
            rng = np.random.default_rng([self.seed, bucket])
            return [rng.standard_normal(shape) for shape in wanted]
        given = [np.asarray(q) for q in self.qs.get(bucket, ())]
        if [q.shape for q in given] != wanted:
            raise ValueError(
                f"PowerSGD qs for bucket {bucket} have shapes {[q.shape for q in given]}, "
                f"expected {wanted}"
            )
        return given


def _orthogonalize(matrix: Any) -> Any:
    """Gram-Schmidt on the columns (torch's choice for ranks up to 2), traced."""
    cols = [matrix[:, i] for i in range(matrix.shape[1])]
    for i in range(len(cols)):
        cols[i] = cols[i] / jnp.linalg.norm(cols[i])
        for j in range(i + 1, len(cols)):
            cols[j] = cols[j] - jnp.sum(cols[i] * cols[j]) * cols[i]
    return jnp.stack(cols, axis=1)


def reduce_bucket(
    leaves: Sequence[Any],
    bucket: int,
    axis_name: str,
    world_size: int,
    hook: PowerSGD,
) -> list[Any]:
    """This device's share of one PowerSGD-reduced bucket: the reduced leaves, in order.

    Raises:
        ValueError: a scalar leaf (torch cannot view it as a matrix either), or given
            ``qs`` of the wrong shapes.
    """
    for k, leaf in enumerate(leaves):
        if leaf.ndim == 0:
            raise ValueError(f"PowerSGD: leaf {k} of bucket {bucket} is a scalar")
    shapes = [tuple(int(d) for d in leaf.shape) for leaf in leaves]
    order, plain = powersgd_layout(shapes, hook.rank, hook.min_compression_rate)
    out: list[Any] = list(leaves)
    if plain:
        flat = jnp.concatenate([jnp.ravel(leaves[k]) for k in plain])
        summed = lax.psum(flat, axis_name) / world_size
        offset = 0
        for k in plain:
            size = int(np.prod(shapes[k]))
            out[k] = summed[offset : offset + size].reshape(shapes[k])
            offset += size
    if not order:
        return out
    mats = [jnp.reshape(leaves[k], (shapes[k][0], -1)) for k in order]
    dtype = mats[0].dtype
    q0 = hook.initial_qs(bucket, [(int(m.shape[0]), int(m.shape[1])) for m in mats])
    qs = [_orthogonalize(jnp.asarray(q, dtype=dtype)) for q in q0]
    ps = [m @ q for m, q in zip(mats, qs, strict=True)]
    summed_ps = _split(lax.psum(_concat(ps), axis_name), ps)
    ps = [_orthogonalize(p) for p in summed_ps]
    qs = [m.T @ p for m, p in zip(mats, ps, strict=True)]
    summed_qs = _split(lax.psum(_concat(qs), axis_name) / world_size, qs)
    for k, p, q in zip(order, ps, summed_qs, strict=True):
        out[k] = (p @ q.T).reshape(shapes[k])
    return out


def _concat(arrays: Sequence[Any]) -> Any:
    return jnp.concatenate([jnp.ravel(a) for a in arrays])


def _split(flat: Any, like: Sequence[Any]) -> list[Any]:
    out = []
    offset = 0
    for a in like:
        out.append(flat[offset : offset + a.size].reshape(a.shape))
        offset += a.size
    return out
