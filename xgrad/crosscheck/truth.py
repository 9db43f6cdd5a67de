"""What backends are measured against: float64 references, compression and PowerSGD models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from xgrad import models as zoo
from xgrad.backend import find_sampler, find_truth
from xgrad.buckets import BucketPlan
from xgrad.crosscheck.case import WIRE_DTYPES, Inputs
from xgrad.powersgd import STATEFUL, STATELESS, PowerSGD, Sampler, compress, layout
from xgrad.powersgd_hook import PowerSGDState, initial_qs


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


def powersgd_config(stateful: bool = False) -> PowerSGD:
    """The PowerSGD a crosscheck case runs on every backend.

    Stateless (the default, :data:`xgrad.powersgd.STATELESS`): rank 1 from the second
    step (the first is the untimed warm-up), so the last step depends on its own draws
    only. Stateful (the multi-step mode, :data:`xgrad.powersgd.STATEFUL`): PyTorch's
    default state from the third step, so the last step depends on every step before it.
    """
    return STATEFUL if stateful else STATELESS


def powersgd_layout(
    shapes: Sequence[tuple[int, ...]], rank: int, min_compression_rate: float
) -> tuple[list[int], list[int]]:
    """Which gradients of a bucket PowerSGD compresses, in torch's processing order.

    (positions of the compressed gradients in that order, positions of the others); see
    :func:`xgrad.powersgd.layout`.
    """
    lay = layout(shapes, rank, min_compression_rate)
    return list(lay.compressed), list(lay.plain)


def torch_powersgd_qs(
    weights: Mapping[str, np.ndarray], plan: BucketPlan, steps: int, seed: int = 0
) -> dict[int, list[np.ndarray]]:
    """The initial ``Q`` torch's ``powerSGD_hook`` draws at its ``steps``-th PowerSGD step.

    Replaying torch's draws (the sampler a backend offers through the registry) lets JAX
    and the numpy model start from the very same random matrices.
    """
    return initial_qs(weights, plan, steps, seed, sampler=find_sampler())


def torch_sampler() -> Sampler | None:
    """PyTorch's normal draws, if the torch backend is here (``xgrad.backend.find_sampler``)."""
    sampler: Sampler | None = find_sampler()
    return sampler


def _stacked(
    inputs_grads: Sequence[Mapping[str, np.ndarray]], names: Sequence[str], dtype: str
) -> dict[str, np.ndarray]:
    model_dtype = zoo.as_dtype(dtype)
    return {
        k: np.stack([g[k].astype(model_dtype).astype(np.float64) for g in inputs_grads])
        for k in names
    }


def powersgd_model(
    rank_grads: Sequence[Mapping[str, np.ndarray]],
    weights: Mapping[str, np.ndarray],
    plan: BucketPlan,
    qs: Mapping[int, Sequence[np.ndarray]],
    dtype: str,
) -> dict[str, np.ndarray]:
    """What an ideal backend returns with one stateless PowerSGD step: torch's algorithm in float64.

    Per-rank gradients are rounded to the model dtype (the best a backend can compute)
    and compressed bucket by bucket from the given initial ``Q`` by
    :func:`xgrad.powersgd.compress`, the ranks stacked on a leading axis.
    """
    names = list(weights)
    n_ranks = len(rank_grads)
    local = _stacked(rank_grads, names, dtype)
    out: dict[str, np.ndarray] = {}
    for b, bucket in enumerate(plan.buckets):
        members = [names[i] for i in bucket]
        lay = layout([weights[n].shape for n in members], POWERSGD_RANK, POWERSGD_MIN_RATE)
        flat = np.concatenate([local[n].reshape(n_ranks, -1) for n in members], axis=1)
        q = np.concatenate([np.ravel(q) for q in qs[b]]) if qs[b] else np.zeros(0)
        reduced, _ = compress(flat, lay, q, _sum_ranks, n_ranks)
        _unpack(reduced[0], members, weights, out)
    return {k: out[k].astype(zoo.as_dtype(dtype)) for k in names}


def powersgd_run(
    rank_grads: Sequence[Mapping[str, np.ndarray]],
    weights: Mapping[str, np.ndarray],
    plan: BucketPlan,
    config: PowerSGD,
    steps: int,
    dtype: str,
    sampler: Sampler | None = None,
) -> dict[str, np.ndarray]:
    """The stateful PowerSGD model: ``steps`` steps at fixed weights, the last one's result.

    The core :class:`~xgrad.powersgd.PowerSGDState` in float64 on the exact per-rank
    gradients (rounded to the model dtype), the ranks stacked on a leading axis, buckets in
    launch order, fresh ``Q`` from ``sampler`` (torch's draws when torch is here).
    """
    names = list(weights)
    n_ranks = len(rank_grads)
    local = _stacked(rank_grads, names, dtype)
    state = PowerSGDState(config, sampler=sampler)
    sample_dtype = zoo.as_dtype(dtype).name
    state.sampler = _in_dtype(state.sampler, sample_dtype)
    out: dict[str, np.ndarray] = {}
    for _ in range(steps):
        for b, bucket in enumerate(plan.buckets):
            members = [names[i] for i in bucket]
            lay = layout(
                [weights[n].shape for n in members],
                config.matrix_approximation_rank,
                config.min_compression_rate,
            )
            flat = np.concatenate([local[n].reshape(n_ranks, -1) for n in members], axis=1)
            last = b == len(plan.buckets) - 1
            reduced = state.reduce(flat, lay, b, last, _sum_ranks, n_ranks)
            _unpack(reduced[0], members, weights, out)
    return {k: out[k].astype(zoo.as_dtype(dtype)) for k in names}


def _in_dtype(sampler: Sampler, dtype: str) -> Sampler:
    """``sampler`` drawing in the model's dtype, as torch does, whatever array it fills."""

    def draw(seed: int, shapes: Sequence[tuple[int, int]], _: str) -> list[np.ndarray]:
        return sampler(seed, shapes, dtype)

    return draw


def _sum_ranks(stacked: np.ndarray) -> np.ndarray:
    """The allreduce of ranks stacked on axis 0: every rank gets the sum in rank order."""
    return np.broadcast_to(np.sum(stacked, axis=0, keepdims=True), stacked.shape)


def _unpack(
    flat: np.ndarray,
    members: Sequence[str],
    weights: Mapping[str, np.ndarray],
    out: dict[str, np.ndarray],
) -> None:
    offset = 0
    for name in members:
        size = int(np.prod(weights[name].shape))
        out[name] = flat[offset : offset + size].reshape(weights[name].shape)
        offset += size
