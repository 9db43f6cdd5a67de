"""Reading the plan XLA chose out of a compiled step's all-reduces."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from xgrad import models  # noqa: E402
from xgrad.jax_backend import models as jm  # noqa: E402
from xgrad.jax_backend.data_parallel import data_parallel_value_and_grad  # noqa: E402
from xgrad.jax_backend.xla_plan import all_reduce_operands, xla_plan  # noqa: E402

HLO = """
  %all-reduce.1 = (f32[], f32[4]{0}, f32[4,3]{1,0}) all-reduce(%a, %b, %c), to_apply=%add
  %x = f32[4]{0} add(%p, %q)
  %all-reduce-start.2 = f32[4]{0} all-reduce-start(%d), to_apply=%add
"""


def test_operands_and_plan_from_hlo_text() -> None:
    assert all_reduce_operands(HLO) == [
        [("float32", ()), ("float32", (4,)), ("float32", (4, 3))],
        [("float32", (4,))],
    ]
    params = [np.zeros((4, 3), np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32)]
    plan = xla_plan(HLO, params)
    assert plan is not None and plan.buckets == ((1, 0), (2,))
    assert plan.limits == (64, 16)
    assert xla_plan(HLO, [*params, np.zeros(7, np.float32)]) is None  # not all-reduced


def test_the_mlp_under_jit_is_one_combined_all_reduce() -> None:
    w = models.init_weights("mlp", 0, "float32")
    x, y = models.make_batch("mlp", 0, 8, "float32")
    step = data_parallel_value_and_grad(jm.make_loss(jm.mlp), world_size=2, mode="jit")
    params = jm.to_params(w)
    plan = xla_plan(step.compiled_text(params, x, y), [params[n] for n in w])
    assert plan is not None
    assert sorted(i for b in plan.buckets for i in b) == list(range(len(w)))
    with pytest.raises(ValueError, match="compiled_text is for mode='jit'"):
        data_parallel_value_and_grad(jm.make_loss(jm.mlp), world_size=2).compiled_text(params, x, y)
