"""DDP's front end: caps to limits to the initial plan to the reducer, shared by backends."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from xgrad import assign_buckets
from xgrad.buckets import NO_LIMIT, BucketPlan
from xgrad.ddp_setup import DDPLimits, ddp_reducer
from xgrad.numpy_ops import NumpyOps
from xgrad.reference import RankError, ReferenceComm, spawn

MIB = 1 << 20


@pytest.mark.parametrize(
    ("kwargs", "initial", "rebuild", "cap"),
    [
        ({}, (NO_LIMIT,), (MIB, 25 * MIB), 25 * MIB),
        ({"find_unused_parameters": True}, (MIB, 25 * MIB), (MIB, 25 * MIB), 25 * MIB),
        (
            {"find_unused_parameters": True, "static_graph": True},
            (NO_LIMIT,),
            (MIB, 25 * MIB),
            25 * MIB,
        ),
        # An explicit cap is the first bucket's too (PyTorch's rule).
        (
            {"find_unused_parameters": True, "bucket_cap_bytes": 4 * MIB},
            (4 * MIB,),
            (4 * MIB, 4 * MIB),
            4 * MIB,
        ),
        ({"bucket_cap_bytes_list": [MIB, 3 * MIB]}, (MIB, 3 * MIB), (MIB, 3 * MIB), 3 * MIB),
        (
            {"bucket_cap_bytes_list": [2 * MIB], "bucket_cap_bytes": 9 * MIB},
            (2 * MIB,),
            (2 * MIB,),
            2 * MIB,
        ),
    ],
)
def test_limits_follow_pytorch(
    kwargs: dict[str, Any], initial: tuple[int, ...], rebuild: tuple[int, ...], cap: int
) -> None:
    assert DDPLimits.of(**kwargs) == DDPLimits(initial, rebuild, cap)


@pytest.mark.parametrize("caps", [[], [MIB, -1], [True]])
def test_bad_cap_list_is_refused(caps: list[Any]) -> None:
    with pytest.raises(ValueError, match=r"bucket_cap_mb_list=.*bucket caps >= 0"):
        DDPLimits.of(bucket_cap_bytes_list=caps)


def test_a_zero_cap_is_a_bucket_per_parameter_as_in_pytorch() -> None:
    assert DDPLimits.of(bucket_cap_bytes_list=[0, MIB]).rebuild == (0, MIB)
    assert assign_buckets([4, 8, 12], [0]).buckets == ((0,), (1,), (2,))


def test_initial_plan_reversed_with_sparse_alone() -> None:
    limits = DDPLimits.of(find_unused_parameters=True, bucket_cap_bytes=16)
    plan = limits.initial_plan([8, 8, 8, 8], sparse=[False, True, False, False])
    # 0 and 2 fill one bucket around the sparse 1 (PyTorch groups by key, not adjacency).
    assert plan.buckets == ((3,), (1,), (0, 2))


def _reducer(comm: ReferenceComm, plan: BucketPlan | None) -> Any:
    params = [np.zeros(2, np.float32) for _ in range(3)]
    reducer = ddp_reducer(
        params, comm, NumpyOps(), set_grad=lambda i, v: None, limits=DDPLimits.of(), plan=plan
    )
    for _ in range(2):
        reducer.rebuild_buckets()
        reducer.prepare_for_backward()
        for i in (2, 1, 0):
            reducer.mark_ready(i, np.ones(2, np.float32))
        reducer.finalize()
    reducer.rebuild_buckets()
    return reducer.rebuild, reducer.has_rebuilt_buckets, reducer.initial_plan, reducer.plan


def test_plan_given_is_used_as_given_and_never_rebuilt() -> None:
    given = BucketPlan(((0,), (1, 2)), (8, 8))
    rebuild, rebuilt, initial, plan = spawn(lambda c: _reducer(c, given), 2)[0]
    assert (rebuild, rebuilt, initial, plan) == (False, False, given, given)


def test_without_a_plan_ddp_starts_with_one_bucket_and_rebuilds_once() -> None:
    rebuild, rebuilt, initial, plan = spawn(lambda c: _reducer(c, None), 2)[0]
    assert rebuild and rebuilt
    assert initial.buckets == ((0, 1, 2),)
    assert plan.buckets == ((2, 1, 0),)  # the ready order


def test_plan_for_other_parameters_is_refused() -> None:
    with pytest.raises(RankError) as err:
        spawn(lambda c: _reducer(c, BucketPlan(((0, 1),), (8,))), 1)
    assert "plan covers 2 parameters but the module has 3" in str(err.value.__cause__)
