"""``run_ddp``: the crosscheck's torch runner, against the single-process full batch."""

from __future__ import annotations

import numpy as np
import pytest

from xgrad import models as zoo
from xgrad.buckets import BucketPlan
from xgrad.torch_backend.crosscheck import run_ddp
from xgrad.torch_backend.models import single_process_grads


@pytest.fixture(scope="module")
def mlp() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    weights = zoo.init_weights("mlp", 0, "float32")
    x, y = zoo.make_batch("mlp", 0, 8, "float32")
    return weights, x, y


def test_xgrad_and_torch_agree_with_the_full_batch(
    mlp: tuple[dict[str, np.ndarray], np.ndarray, np.ndarray],
) -> None:
    weights, x, y = mlp
    reference = single_process_grads("mlp", weights, x, y)
    ours = run_ddp("mlp", weights, x, y, world_size=2, steps=1, timeout=120)
    theirs = run_ddp("mlp", weights, x, y, world_size=2, implementation="torch", timeout=120)
    assert list(ours["grads"]) == list(weights)
    for name, ref in reference.items():
        np.testing.assert_array_equal(ours["grads"][name], theirs["grads"][name])
        np.testing.assert_allclose(ours["grads"][name], ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    assert ours["plan"] == theirs["plan"]  # the same rebuilt plan
    assert ours["seconds_per_step"] > 0 and theirs["seconds_per_step"] > 0


def test_explicit_plan_and_hook(mlp: tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]) -> None:
    weights, x, y = mlp
    n = len(weights)
    plan = BucketPlan(tuple((i,) for i in reversed(range(n))), (1,) * n)
    answer = run_ddp("mlp", weights, x, y, world_size=2, plan=plan, hook="fp16", timeout=120)
    assert answer["plan"] == plan  # used as given, never rebuilt
    reference = single_process_grads("mlp", weights, x, y)
    for name, ref in reference.items():
        np.testing.assert_allclose(
            answer["grads"][name], ref, rtol=0, atol=2e-3 * np.abs(ref).max()
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"implementation": "jax"}, "implementation='jax'"),
        ({"hook": "int8"}, "hook='int8'"),
        ({"implementation": "torch", "plan": BucketPlan(((0,),), (1,))}, "plan= is for"),
        ({"steps": 0}, "steps=0"),
        ({"world_size": 3}, "does not split evenly over world_size=3"),
    ],
)
def test_bad_arguments(
    mlp: tuple[dict[str, np.ndarray], np.ndarray, np.ndarray], kwargs: dict, message: str
) -> None:
    weights, x, y = mlp
    options = {"world_size": 2} | kwargs
    with pytest.raises(ValueError, match=message):
        run_ddp("mlp", weights, x, y, **options)


def test_pytorchs_plan_follows_its_first_bucket_cap_as_set_when_it_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    import torch.distributed as dist

    from xgrad.torch_backend.crosscheck import _plan_in_use

    params = [torch.zeros(1 << 16) for _ in range(4)]  # 256 KiB each
    ready = [3, 2, 1, 0]
    default = _plan_in_use(object(), params, ready, None)
    assert default.buckets[0] == (3, 2, 1, 0)  # 1 MiB: all four in the first bucket
    monkeypatch.setattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 18)
    lowered = _plan_in_use(object(), params, ready, None)
    assert lowered.buckets[0] == (3,)  # a script lowered it: PyTorch's first bucket shrinks
