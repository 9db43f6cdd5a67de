"""What backends are measured against: float64 references, compression and PowerSGD models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from xgrad import models as zoo
from xgrad.backend import find_truth
from xgrad.buckets import BucketPlan
from xgrad.crosscheck.case import WIRE_DTYPES, Inputs


def reference_grads(inputs: Inputs) -> tuple[dict[str, np.ndarray], str]:
    """Full-batch float64 gradients and a line saying how they were computed.

    They come from a registered backend's :class:`~xgrad.backend.Truth`: one computed by a
    framework's own autograd where an available backend offers one for the model.
    """
    truth = find_truth(inputs.case.model)
    return truth.grads(inputs.case.model, inputs.weights, inputs.x, inputs.y), truth.description


def per_rank_grads(inputs: Inputs) -> list[dict[str, np.ndarray]]:
    """Each rank's float64 gradient of its own shard, for the compression model."""
    case = inputs.case
    truth = find_truth(case.model)
    return [
        truth.grads(
            case.model,
            inputs.weights,
            zoo.shard(inputs.x, case.world_size, r),
            zoo.shard(inputs.y, case.world_size, r),
        )
        for r in range(case.world_size)
    ]


def compression_model(
    rank_grads: Sequence[Mapping[str, np.ndarray]], hook: str, dtype: str
) -> dict[str, np.ndarray]:
    """What an ideal backend with ``hook`` returns: exact per-rank gradients, compressed.

    Each rank's gradient is rounded to the model dtype (the best a backend can compute),
    cast to the wire dtype and divided by the world size there, summed over ranks in rank
    order in the wire dtype, and cast back: ``xgrad.hooks``' arithmetic, in numpy.
    """
    wire = zoo.as_dtype(WIRE_DTYPES[hook])
    model_dtype = zoo.as_dtype(dtype)
    n = len(rank_grads)
    out = {}
    for name in rank_grads[0]:
        total = None
        for grads in rank_grads:
            part = (grads[name].astype(model_dtype).astype(wire) / wire.type(n)).astype(wire)
            total = part if total is None else (total + part).astype(wire)
        assert total is not None
        out[name] = total.astype(model_dtype)
    return out


#: torch's ``PowerSGDState`` as xgrad's torch runner sets it: rank 1, PowerSGD from the
#: second step on (the first is the untimed warm-up), no error feedback, no warm start.
POWERSGD_RANK = 1
POWERSGD_MIN_RATE = 2.0


def powersgd_layout(
    shapes: Sequence[tuple[int, ...]], rank: int, min_compression_rate: float
) -> tuple[list[int], list[int]]:
    """Which gradients of a bucket PowerSGD compresses, in torch's processing order.

    Each gradient is viewed as an ``(n, m) = (shape[0], -1)`` matrix and compressed when
    ``(n + m) * min(n, m, rank) * min_compression_rate < n * m``. Torch processes the
    compressed ones grouped by matrix shape, groups in order of first appearance, which
    fixes the order of its random ``Q`` draws.

    Returns:
        (positions of the compressed gradients in that order, positions of the others).
    """
    mats = [(s[0], int(np.prod(s[1:]))) for s in shapes]
    compressed: list[int] = []
    plain: list[int] = []
    for k, (n, m) in enumerate(mats):
        r = min(n, m, rank)
        (compressed if (n + m) * r * min_compression_rate < n * m else plain).append(k)
    groups: dict[tuple[int, int], list[int]] = {}
    for k in compressed:
        groups.setdefault(mats[k], []).append(k)
    return [k for group in groups.values() for k in group], plain


def orthogonalize(matrix: np.ndarray) -> np.ndarray:
    """Gram-Schmidt on the columns, as torch's PowerSGD does for ranks up to 2."""
    out = np.array(matrix, dtype=np.float64, copy=True)
    for i in range(out.shape[1]):
        out[:, i] /= np.linalg.norm(out[:, i])
        rest = out[:, i + 1 :]
        rest -= np.sum(out[:, i : i + 1] * rest, axis=0, keepdims=True) * out[:, i : i + 1]
    return out


def bucket_matrices(
    weights: Mapping[str, np.ndarray], plan: BucketPlan, bucket: Sequence[int]
) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """A bucket's PowerSGD layout: compressed gradients in order, plain ones, matrix shapes.

    Shared by the float64 PowerSGD model and the replay of torch's draws, which must agree
    on which gradients are compressed as which ``(n, m)`` matrices.
    """
    names = list(weights)
    shapes = [tuple(weights[names[i]].shape) for i in bucket]
    order, plain = powersgd_layout(shapes, POWERSGD_RANK, POWERSGD_MIN_RATE)
    mats = [(shapes[k][0], int(np.prod(shapes[k][1:]))) for k in order]
    return order, plain, mats


def torch_powersgd_qs(
    weights: Mapping[str, np.ndarray], plan: BucketPlan, steps: int, seed: int = 0
) -> dict[int, list[np.ndarray]]:
    """The initial ``Q`` torch's ``powerSGD_hook`` draws at its ``steps``-th PowerSGD step.

    Replaying torch's draws lets JAX and the numpy model start from the very same random
    matrices. Needs torch: the draws are made in
    :func:`xgrad.torch_backend.powersgd.initial_qs`.
    """
    from xgrad.torch_backend.powersgd import initial_qs

    return initial_qs(weights, plan, steps, seed)


def powersgd_model(
    rank_grads: Sequence[Mapping[str, np.ndarray]],
    weights: Mapping[str, np.ndarray],
    plan: BucketPlan,
    qs: Mapping[int, Sequence[np.ndarray]],
    dtype: str,
) -> dict[str, np.ndarray]:
    """What an ideal backend returns with PowerSGD: torch's algorithm in float64.

    Per-rank gradients are rounded to the model dtype (the best a backend can compute)
    and compressed bucket by bucket from the given initial ``Q``.
    """
    names = list(weights)
    model_dtype = zoo.as_dtype(dtype)
    n_ranks = len(rank_grads)
    local = [{k: g[k].astype(model_dtype).astype(np.float64) for k in names} for g in rank_grads]
    out: dict[str, np.ndarray] = {}
    for b, bucket in enumerate(plan.buckets):
        order, plain, _ = bucket_matrices(weights, plan, bucket)
        for k in plain:
            name = names[bucket[k]]
            out[name] = np.sum([g[name] for g in local], axis=0) / n_ranks
        for k, q0 in zip(order, qs[b], strict=True):
            name = names[bucket[k]]
            shape = weights[name].shape
            mats = [g[name].reshape(shape[0], -1) for g in local]
            q = orthogonalize(q0)
            p = orthogonalize(sum(m @ q for m in mats))
            q = sum(m.T @ p for m in mats) / n_ranks
            out[name] = (p @ q.T).reshape(shape)
    return {k: out[k].astype(model_dtype) for k in names}
