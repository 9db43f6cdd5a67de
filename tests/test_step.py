"""A data-parallel step as data: the seeded step of a zoo model and its capped plan."""

from __future__ import annotations

import numpy as np

from xgrad import models as zoo
from xgrad.step import Step, capped_plan, make_step


def test_make_step_is_seeded_and_capped() -> None:
    step = make_step("mlp", world_size=4, dtype="float64", bucket_cap_bytes=4096, seed=3)
    again = make_step("mlp", world_size=4, dtype="float64", bucket_cap_bytes=4096, seed=3)
    assert isinstance(step, Step) and step.dtype == "float64"
    assert list(step.weights) == list(zoo.param_names("mlp"))
    assert step.x.shape[0] == 4 * 4 and step.y.shape[0] == 16
    assert all(np.array_equal(step.weights[k], again.weights[k]) for k in step.weights)
    assert step.plan == capped_plan(step.weights, 4096)
    # DDP's assignment for that cap (in parameter order), launched last bucket first.
    assert step.plan.buckets == ((3, 4, 5), (1, 2), (0,))
    assert step.plan.limits == (4096, 4096, 4096)
