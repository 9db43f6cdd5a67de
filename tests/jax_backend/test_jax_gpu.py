"""On CUDA (``make gpu``): JAX's data-parallel step and the crosscheck on the GPUs."""

from __future__ import annotations

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")


def _gpus() -> int:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpus() == 0, reason="needs a CUDA device visible to JAX"),
]


def test_gpu_step_matches_the_cpu_step_to_tf32() -> None:
    from xgrad import models
    from xgrad.jax_backend import models as jm
    from xgrad.jax_backend.data_parallel import data_parallel_value_and_grad

    w = models.init_weights("mlp", 0, "float32")
    x, y = models.make_batch("mlp", 0, 8, "float32")
    world = min(_gpus(), 2)
    out = {}
    for platform in ("gpu", "cpu"):
        step = data_parallel_value_and_grad(
            jm.make_loss(jm.mlp), world_size=world, devices=jax.devices(platform)[:world]
        )
        out[platform] = step(jm.to_params(w), x, y)[1]
    for k in w:
        scale = float(np.abs(np.asarray(out["cpu"][k])).max())
        assert np.abs(np.asarray(out["gpu"][k]) - np.asarray(out["cpu"][k])).max() <= 1e-2 * scale


def test_crosscheck_on_cuda_reports_against_the_cpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    from xgrad import crosscheck

    case = crosscheck.Case(world_size=1, steps=1, device="cuda")
    report = crosscheck.run_crosscheck(
        case, backends=["torch-xgrad", "torch-ddp", "jax-shard_map", "jax-jit"]
    )
    assert [b.status for b in report.backends] == ["ok"] * 4, [b.reason for b in report.backends]
    lines = [s for s in report.agreement if "cuda vs cpu" in s]
    assert len(lines) == 4, report.agreement
