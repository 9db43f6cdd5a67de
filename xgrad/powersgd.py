"""PowerSGD as PyTorch's ``powerSGD_hook`` runs it, written once for every array library.

PowerSGD (Vogels et al., 2019) replaces the allreduce of a gradient matrix ``M`` (``n x m``)
by two allreduces of thin matrices: ``P = M Q`` summed over ranks and orthogonalised,
then ``Q = M^T P`` summed and divided by the world size; every rank ends with ``P Q^T``.
This module holds the parts every backend shares, so that torch, JAX and the crosscheck's
float64 truth run one algorithm and disagree only where their arithmetic does:

- :class:`PowerSGD`: the hyperparameters, named and defaulted as ``PowerSGDState``'s;
- :func:`layout`: which gradients of a bucket are compressed, in torch's order;
- :func:`orthogonalize` and :func:`compress`: one round, functional, on any array-API
  array (NumPy, torch, JAX tracers), with any number of leading axes (the truth stacks
  the ranks on one); ``allreduce`` is a parameter, so it is ``lax.psum`` under JAX, a
  ``Comm`` collective on real ranks and a sum over the stacked axis in the truth;
- the stateful hook (error feedback, warm start, ``start_powerSGD_iter``) for xgrad's
  reducers, its state kept on the host as torch keeps it, is :mod:`xgrad.powersgd_hook`.

Random ``Q`` are drawn as torch draws them: one seed per bucket from
``numpy.random.RandomState(random_seed)`` each time a bucket needs fresh ``Q`` (every
PowerSGD step without warm start, the first one with it), then a normal block per
compressed gradient. The block itself comes from a :data:`Sampler`; the torch backend
provides one that replays ``torch.randn`` exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "STATEFUL",
    "STATELESS",
    "AllReduce",
    "Layout",
    "PowerSGD",
    "Sampler",
    "compress",
    "layout",
    "numpy_sampler",
    "orthogonalize",
]

#: ``sampler(seed, shapes, dtype_name) -> arrays``: one standard normal block per
#: ``(m, rank)`` shape, drawn in order from a generator seeded with ``seed``, with values
#: representable in ``dtype_name`` (returned as float64 NumPy arrays).
Sampler = Callable[[int, Sequence[tuple[int, int]], str], list[np.ndarray]]

#: ``allreduce(array) -> sum of array over ranks``; blocking.
AllReduce = Callable[[Any], Any]


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


@dataclass(frozen=True)
class PowerSGD:
    """PowerSGD's hyperparameters, as ``torch.distributed``'s ``PowerSGDState`` names them.

    Attributes:
        matrix_approximation_rank: the rank of the approximation (1 compresses most).
        start_powerSGD_iter: plain averaging (divide, then sum) for this many steps first;
            compressing from the very start often derails training.
        min_compression_rate: compress a matrix only if it shrinks more than this.
        use_error_feedback: add what compression lost last step to this step's gradient.
        warm_start: start each step's power iteration from last step's ``Q``.
        orthogonalization_epsilon: added to column norms (a zero column divides by zero).
        random_seed: seeds the draws of fresh ``Q``.

    Raises:
        ValueError: a value out of range, or error feedback / warm start with
            ``start_powerSGD_iter <= 1`` (refused as PyTorch refuses it: DDP rebuilds its
            buckets after the first step, which would mismatch memorised state).
    """

    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1_000
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    random_seed: int = 0

    def __post_init__(self) -> None:
        rank = self.matrix_approximation_rank
        if not _is_int(rank) or rank < 1:
            raise ValueError(f"PowerSGD matrix_approximation_rank={rank!r}: expected an int >= 1")
        start = self.start_powerSGD_iter
        if not _is_int(start) or start < 0:
            raise ValueError(f"PowerSGD start_powerSGD_iter={start!r}: expected an int >= 0")
        for label in ("min_compression_rate", "orthogonalization_epsilon"):
            value = getattr(self, label)
            if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
                raise TypeError(f"PowerSGD {label}={value!r}: expected a number")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"PowerSGD {label}={value!r}: expected a finite number >= 0")
        for label in ("use_error_feedback", "warm_start"):
            if not isinstance(getattr(self, label), bool):
                raise TypeError(f"PowerSGD {label}={getattr(self, label)!r}: expected a bool")
        if not _is_int(self.random_seed) or not 0 <= self.random_seed < 2**32:
            raise ValueError(
                f"PowerSGD random_seed={self.random_seed!r}: expected 0 <= int < 2**32"
            )
        if (self.use_error_feedback or self.warm_start) and start <= 1:
            raise ValueError(
                f"PowerSGD start_powerSGD_iter={start!r}: expected > 1 with use_error_feedback "
                "or warm_start (as PyTorch's PowerSGDState: state memorised before DDP "
                "rebuilds its buckets after step 1 would not fit them)"
            )

    @property
    def stateless(self) -> bool:
        """No state carried from step to step beyond the step count."""
        return not (self.use_error_feedback or self.warm_start)


#: torch's hook as the crosscheck compares it by default: rank 1 from the second step,
#: nothing carried from step to step (each step depends on its own draws only).
STATELESS = PowerSGD(1, 1, 2.0, use_error_feedback=False, warm_start=False)

#: PyTorch's default state (error feedback, warm start), rank 1, from the third step (the
#: earliest PyTorch allows with that state): the crosscheck's multi-step mode.
STATEFUL = PowerSGD(1, 2, 2.0)


@dataclass(frozen=True)
class Layout:
    """How PowerSGD sees one bucket: which gradients it compresses, as which matrices.

    Attributes:
        shapes: the gradients' shapes, in bucket order.
        compressed: positions of the compressed gradients, in torch's processing order
            (grouped by matrix shape, groups in order of first appearance): the order of
            the ``P`` and ``Q`` blocks on the wire and of the random draws.
        plain: positions of the others (averaged uncompressed), in bucket order.
        matrices: ``(n, m)`` of each compressed gradient (``shape[0]`` by the rest).
        ranks: the approximation rank of each, ``min(n, m, rank)``.
    """

    shapes: tuple[tuple[int, ...], ...]
    compressed: tuple[int, ...]
    plain: tuple[int, ...]
    matrices: tuple[tuple[int, int], ...]
    ranks: tuple[int, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each gradient starts in the flat bucket."""
        out, total = [], 0
        for size in self.sizes:
            out.append(total)
            total += size
        return tuple(out)

    @property
    def length(self) -> int:
        return sum(self.sizes)

    @property
    def q_shapes(self) -> tuple[tuple[int, int], ...]:
        """``(m, rank)`` of each compressed gradient's ``Q``, in order."""
        return tuple((m, r) for (_, m), r in zip(self.matrices, self.ranks, strict=True))

    @property
    def q_size(self) -> int:
        return sum(m * r for m, r in self.q_shapes)

    @property
    def p_size(self) -> int:
        return sum(n * r for (n, _), r in zip(self.matrices, self.ranks, strict=True))


def layout(shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float) -> Layout:
    """The :class:`Layout` of a bucket of gradients of ``shapes``.

    A gradient, viewed as ``(n, m) = (shape[0], -1)``, is compressed when
    ``(n + m) * min(n, m, rank) * min_compression_rate < n * m`` (PyTorch's rule).

    Raises:
        ValueError: a scalar gradient (it has no matrix view; torch fails on it too).
    """
    dims = [tuple(int(d) for d in s) for s in shapes]
    mats: list[tuple[int, int]] = []
    for k, shape in enumerate(dims):
        if not shape:
            raise ValueError(f"PowerSGD: gradient {k} of the bucket is a scalar (shape ())")
        mats.append((shape[0], math.prod(shape[1:])))
    chosen: list[int] = []
    plain: list[int] = []
    for k, (n, m) in enumerate(mats):
        r = min(n, m, rank)
        (chosen if (n + m) * r * min_compression_rate < n * m else plain).append(k)
    groups: dict[tuple[int, int], list[int]] = {}
    for k in chosen:
        groups.setdefault(mats[k], []).append(k)
    order = tuple(k for group in groups.values() for k in group)
    return Layout(
        shapes=tuple(dims),
        compressed=order,
        plain=tuple(plain),
        matrices=tuple(mats[k] for k in order),
        ranks=tuple(min(*mats[k], rank) for k in order),
    )


def array_namespace(x: Any) -> Any:
    try:
        from array_api_compat import array_namespace
    except ImportError as err:
        raise ImportError(
            "xgrad's PowerSGD needs array-api-compat: pip install 'xgrad[hooks]'"
        ) from err
    return array_namespace(x)


def orthogonalize(matrix: Any, epsilon: float = 0.0) -> Any:
    """Gram-Schmidt on the columns of the last two axes (torch's method for ranks <= 2).

    Functional (a new array; JAX tracers welcome). Column ``i`` is divided by its norm
    (plus ``epsilon``), then projected out of the columns after it, as torch does in place.
    A zero column divides by zero (NaN), as in torch, unless ``epsilon > 0``.
    """
    xp = array_namespace(matrix)
    cols = [matrix[..., i : i + 1] for i in range(matrix.shape[-1])]
    for i in range(len(cols)):
        norm = xp.linalg.vector_norm(cols[i], axis=-2, keepdims=True)
        cols[i] = cols[i] / (norm + epsilon) if epsilon else cols[i] / norm
        for j in range(i + 1, len(cols)):
            cols[j] = cols[j] - xp.sum(cols[i] * cols[j], axis=-2, keepdims=True) * cols[i]
    return cols[0] if len(cols) == 1 else xp.concat(cols, axis=-1)


def _pieces(xp: Any, flat: Any, shapes: Sequence[tuple[int, ...]]) -> list[Any]:
    lead = tuple(flat.shape[:-1])
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(xp.reshape(flat[..., offset : offset + size], (*lead, *shape)))
        offset += size
    return out


def _flat(xp: Any, arrays: Sequence[Any], lead: int) -> Any:
    return xp.concat([xp.reshape(a, (*a.shape[:lead], -1)) for a in arrays], axis=-1)


def compress(
    flat: Any,
    lay: Layout,
    q: Any,
    allreduce: AllReduce,
    world_size: int,
    epsilon: float = 0.0,
) -> tuple[Any, Any]:
    """One PowerSGD round over a flat bucket: ``(reduced bucket, reduced Q)``.

    The arithmetic and order of torch's hook: the plain gradients are concatenated, summed
    and divided by the world size; ``q`` (the compressed gradients' ``Q`` blocks
    concatenated, not yet orthogonalised: fresh draws or last step's) is orthogonalised;
    all ``P = M Q`` travel in one sum and are orthogonalised; all ``Q = M^T P`` travel in
    one sum and are divided by the world size; each compressed gradient becomes ``P Q^T``.

    Args:
        flat: this rank's bucket, shape ``(..., lay.length)`` (leading axes are batch
            axes, e.g. stacked simulated ranks).
        lay: the bucket's :class:`Layout`.
        q: shape ``(..., lay.q_size)``.
        allreduce: sums an array over ranks (three calls: plain part, ``P``, ``Q``; the
            first is skipped when nothing is plain, as torch sends an empty one).
        world_size: the divisor of the mean.
        epsilon: see :func:`orthogonalize`.

    Returns:
        The reduced bucket (same shape as ``flat``) and the reduced ``Q``, which warm start
        feeds to the next step.
    """
    xp = array_namespace(flat)
    lead = len(flat.shape) - 1
    grads = _pieces(xp, flat, lay.shapes)
    out = list(grads)
    if lay.plain:
        summed = allreduce(_flat(xp, [grads[k] for k in lay.plain], lead)) / world_size
        for k, part in zip(
            lay.plain, _pieces(xp, summed, [lay.shapes[k] for k in lay.plain]), strict=True
        ):
            out[k] = part
    if not lay.compressed:
        return _flat(xp, out, lead), q
    lead_shape = tuple(flat.shape[:-1])
    mats = [
        xp.reshape(grads[k], (*lead_shape, n, m))
        for k, (n, m) in zip(lay.compressed, lay.matrices, strict=True)
    ]
    qs = [orthogonalize(block, epsilon) for block in _pieces(xp, q, lay.q_shapes)]
    ps = [mat @ block for mat, block in zip(mats, qs, strict=True)]
    p_shapes = [tuple(p.shape[-2:]) for p in ps]
    ps_sum = _pieces(xp, allreduce(_flat(xp, ps, len(ps[0].shape) - 2)), p_shapes)
    ps = [orthogonalize(p, epsilon) for p in ps_sum]
    qs = [xp.matrix_transpose(mat) @ p for mat, p in zip(mats, ps, strict=True)]
    q_sum = allreduce(_flat(xp, qs, len(qs[0].shape) - 2)) / world_size
    for k, p, block in zip(lay.compressed, ps, _pieces(xp, q_sum, lay.q_shapes), strict=True):
        out[k] = xp.reshape(p @ xp.matrix_transpose(block), (*lead_shape, *lay.shapes[k]))
    return _flat(xp, out, lead), q_sum


def numpy_sampler(seed: int, shapes: Sequence[tuple[int, int]], dtype: str) -> list[np.ndarray]:
    """Normal draws from NumPy (for backends without a generator of their own to replay)."""
    rng = np.random.default_rng(seed)
    wire = np.dtype(dtype) if dtype in ("float16", "float32", "float64") else np.dtype("float32")
    return [rng.standard_normal(shape).astype(wire).astype(np.float64) for shape in shapes]
