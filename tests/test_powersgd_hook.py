"""xgrad.powersgd_hook: the stateful hook on NumPy ranks and under xgrad's torch DDP."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from xgrad import models
from xgrad.crosscheck import Case, make_inputs, per_rank_grads, powersgd_run
from xgrad.powersgd import PowerSGD, layout
from xgrad.powersgd_hook import PowerSGDState, powersgd_hook
from xgrad.reducer import GradBucket
from xgrad.reference.comm import spawn as reference_spawn

CONFIG = PowerSGD(start_powerSGD_iter=2)


def test_state_counts_steps_and_keeps_error_and_q() -> None:
    state = PowerSGDState(CONFIG)
    lay = layout([(4, 6), (4,)], 1, 2.0)
    rng = np.random.default_rng(0)
    flat = rng.standard_normal(lay.length)
    for k in range(4):
        out = state.reduce(flat, lay, 0, True, lambda x: x, 1)
        if k < 2:  # plain averaging before start_powerSGD_iter, nothing remembered
            assert np.array_equal(out, flat) and not state.error_dict
    assert state.iter == 4 and set(state.q_memory_dict) == {0}
    # Error feedback: what the last step lost is kept, and the uncompressed bias is exact.
    assert np.abs(state.error_dict[0][:24]).max() > 0
    assert np.array_equal(out[24:], flat[24:])


def test_hook_on_reference_ranks_equals_the_stacked_model() -> None:
    """Two simulated NumPy ranks, three buckets, five steps: the same as the truth's model."""
    case = Case(world_size=2, hook="powersgd", stateful=True, steps=4)
    inputs = make_inputs(case)
    pytest.importorskip("torch")  # per-rank float64 gradients come from torch
    rank_grads = per_rank_grads(inputs)
    names = list(inputs.weights)
    plan = inputs.plan

    def rank_main(comm: Any) -> dict[str, np.ndarray]:
        hook = powersgd_hook(comm, CONFIG)
        grads = rank_grads[comm.rank]
        out: dict[str, np.ndarray] = {}
        for _ in range(case.steps + 1):
            for b, bucket in enumerate(plan.buckets):
                parts = [grads[names[i]] for i in bucket]
                flat = np.concatenate([p.ravel() for p in parts])
                views = [p for p in parts]
                bucket_obj = GradBucket(b, flat, views, [], b == len(plan.buckets) - 1)
                reduced = hook(bucket_obj).wait()
                offset = 0
                for i, p in zip(bucket, parts, strict=True):
                    out[names[i]] = reduced[offset : offset + p.size].reshape(p.shape)
                    offset += p.size
        return out

    results = reference_spawn(rank_main, 2, timeout=30)
    model = powersgd_run(rank_grads, inputs.weights, plan, CONFIG, case.steps + 1, "float64")
    for name in names:
        assert np.array_equal(results[0][name], results[1][name])
        assert np.allclose(results[0][name], model[name], rtol=1e-10, atol=1e-12), name


def _torch_rank(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """xgrad's DDP on gloo, once with PyTorch's powerSGD_hook and once with xgrad's."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from xgrad.torch_backend import models as tm
    from xgrad.torch_backend.ddp import DistributedDataParallel
    from xgrad.torch_backend.powersgd import torch_sampler

    weights = models.init_weights("mlp", 0, "float32")
    x, y = models.make_batch("mlp", 0, 8, "float32")
    x = torch.from_numpy(models.shard(x, world_size, rank))
    y = torch.from_numpy(models.shard(y, world_size, rank))
    out = {}
    for label in ("torch", "xgrad"):
        module = tm.build("mlp", weights)
        if label == "torch":
            ddp = DistributedDataParallel(module, bucket_cap_mb=0.002)
            kwargs = {k: getattr(CONFIG, k) for k in CONFIG.__dataclass_fields__}
            ddp.register_comm_hook(psgd.PowerSGDState(None, **kwargs), psgd.powerSGD_hook)
        else:
            state = PowerSGDState(CONFIG, sampler=torch_sampler)
            ddp = DistributedDataParallel(
                module, bucket_cap_mb=0.002, comm_hook=lambda comm, s=state: powersgd_hook(comm, s)
            )
        for _ in range(steps):
            module.zero_grad(set_to_none=True)
            tm.loss(ddp(x), y).backward()
        out[label] = {n: tm.to_numpy(p.grad) for n, p in module.named_parameters()}
    return out


def test_under_xgrads_torch_ddp_it_equals_pytorchs_hook() -> None:
    """Six steps (four compressed, error feedback and warm start), several buckets."""
    pytest.importorskip("torch")
    from xgrad.torch_backend.spawn import spawn

    answer = spawn(_torch_rank, 2, args=(6,), timeout=60)[0]
    for name, expected in answer["torch"].items():
        got = answer["xgrad"][name]
        scale = np.abs(expected).max()
        assert np.abs(got - expected).max() <= 1e-5 * scale, name
