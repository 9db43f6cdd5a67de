"""Bucket plans: literal cases, PyTorch's own assignment as the reference, invariants."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xgrad.buckets import (
    NO_LIMIT,
    BucketPlan,
    assign_buckets,
    cap_mb_to_bytes,
    ddp_bucket_caps,
    ddp_initial_plan,
    rebuild_plan,
)


def test_literal_plans() -> None:
    assert assign_buckets([4, 4, 4, 4], [8]).buckets == ((0, 1), (2, 3))
    # The first limit applies to the first bucket only; the last one repeats.
    plan = assign_buckets([4, 4, 4, 4, 4, 4, 4], [4, 8])
    assert plan.buckets == ((0,), (1, 2), (3, 4), (5, 6))
    assert plan.limits == (4, 8, 8, 8)
    # A bucket closes once it reaches its cap, so a large parameter ends one.
    assert assign_buckets([1, 100, 1, 1], [50]).buckets == ((0, 1), (2, 3))


def test_keys_are_never_mixed_and_buckets_sorted_by_smallest_index() -> None:
    plan = assign_buckets([4, 4, 4, 4], [8], keys=["f32", "f16", "f32", "f16"])
    assert plan.buckets == ((0, 2), (1, 3))


def test_sparse_gradients_get_their_own_bucket_without_limit() -> None:
    plan = assign_buckets([4, 400, 4], [8], sparse=[False, True, False])
    assert plan.buckets == ((0, 2), (1,))
    assert plan.limits == (8, 0)


def test_rebuild_keeps_ready_order() -> None:
    plan = rebuild_plan([4, 4, 4, 4], [3, 2, 1, 0], bucket_cap_bytes=8, first_bucket_cap_bytes=4)
    assert plan.buckets == ((3,), (2, 1), (0,))
    assert plan.limits == (4, 8, 8)


def test_ddp_initial_plan_is_reversed_and_unbucketed_unless_unused_are_searched() -> None:
    sizes = [2 << 20] * 4
    assert ddp_initial_plan(sizes).buckets == ((0, 1, 2, 3),)
    assert ddp_initial_plan(sizes).limits == (NO_LIMIT,)
    plan = ddp_initial_plan(sizes, find_unused_parameters=True)
    # 1 MiB first bucket, then 25 MiB: (0), (1, 2, 3) — launched in reverse.
    assert plan.buckets == ((1, 2, 3), (0,))
    explicit = ddp_initial_plan(sizes, find_unused_parameters=True, bucket_cap_bytes=4 << 20)
    assert explicit.buckets == ((2, 3), (0, 1))


def test_ddp_bucket_caps_follow_pytorch_defaults() -> None:
    assert ddp_bucket_caps() == (1 << 20, 25 << 20)
    assert ddp_bucket_caps(4096) == (4096, 4096)  # an explicit cap applies to the first too
    assert ddp_bucket_caps(4096, 100) == (100, 4096)
    assert ddp_bucket_caps(None, 100) == (100, 25 << 20)


def test_json_round_trip_and_digest() -> None:
    plan = assign_buckets([3, 5, 7, 11], [8], keys=["a", "b", "a", "b"])
    again = BucketPlan.from_json(plan.to_json())
    assert again == plan
    assert again.digest() == plan.digest()
    assert plan.digest() != plan.reversed().digest()
    assert plan.bucket_of()[3] == (1, 1)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"nbytes": [], "limits": [8]}, "nbytes is empty"),
        ({"nbytes": [4, -1], "limits": [8]}, "nbytes[1] = -1"),
        ({"nbytes": [4], "limits": []}, "limits is empty"),
        ({"nbytes": [4], "limits": [8, -1]}, "limits[1] = -1"),
        ({"nbytes": [4, 4], "limits": [8], "keys": ["a"]}, "keys has 1 entries for 2"),
        ({"nbytes": [4, 4], "limits": [8], "sparse": [True]}, "sparse has 1 entries"),
        ({"nbytes": [4, 4], "limits": [8], "order": [0, 0]}, "permutation of 0..1"),
    ],
)
def test_bad_input_names_the_value(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        assign_buckets(**kwargs)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("buckets", "limits", "needle"),
    [
        (((0,), (0,)), (1, 1), "more than one bucket"),
        (((0,), (2,)), (1, 1), "in no bucket"),
        (((0,),), (1, 1), "one limit per bucket"),
        (((),), (1,), "is empty"),
    ],
)
def test_invalid_plans_are_refused(buckets: tuple, limits: tuple, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        BucketPlan(buckets, limits)
    assert needle in str(err.value)


sizes = st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=40)


@given(
    nbytes=sizes,
    limits=st.lists(st.integers(min_value=1, max_value=6000), min_size=1, max_size=3),
    data=st.data(),
)
def test_invariants(nbytes: list[int], limits: list[int], data: st.DataObject) -> None:
    n = len(nbytes)
    keys = data.draw(st.lists(st.sampled_from("ab"), min_size=n, max_size=n))
    order = data.draw(st.permutations(range(n)))
    plan = assign_buckets(nbytes, limits, keys=keys, order=order)
    flat = sorted(i for b in plan.buckets for i in b)
    assert flat == list(range(n))  # every parameter in exactly one bucket
    for bucket, limit in zip(plan.buckets, plan.limits, strict=True):
        assert len({keys[i] for i in bucket}) == 1  # keys never mixed
        total = sum(nbytes[i] for i in bucket)
        # Over the limit only because its last parameter pushed it over.
        assert total - nbytes[bucket[-1]] < limit
    assert BucketPlan.from_json(plan.to_json()) == plan


def test_same_assignment_as_pytorch() -> None:
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    dtypes = [torch.float32, torch.float16, torch.float64, torch.bfloat16]
    rng = random.Random(0)
    for _ in range(600):
        n = rng.randint(1, 30)
        tensors = [torch.empty(rng.randint(0, 300), dtype=rng.choice(dtypes)) for _ in range(n)]
        limits = [rng.randint(0, 2000) for _ in range(rng.randint(1, 3))]
        sparse = [rng.random() < 0.1 for _ in range(n)] if rng.random() < 0.5 else []
        order = list(range(n))
        rng.shuffle(order)
        # With several keys the buckets still open at the end come in the order of
        # PyTorch's hash map: the reverse of their keys' first appearance.
        use_order = rng.random() < 0.5
        if use_order:
            ref = dist._compute_bucket_assignment_by_size(
                [tensors[i] for i in order], limits, sparse, order
            )
        else:
            ref = dist._compute_bucket_assignment_by_size(tensors, limits, sparse)
        plan = assign_buckets(
            [t.numel() * t.element_size() for t in tensors],
            limits,
            keys=[t.dtype for t in tensors],
            sparse=sparse or None,
            order=order if use_order else None,
        )
        assert plan.buckets == tuple(tuple(b) for b in ref[0])
        assert plan.limits == tuple(ref[1])


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"buckets":[[0,1.7]],"limits":[8]}', "1.7"),
        ('{"buckets":[[0,1]],"limits":[-1]}', "-1"),
        ('{"buckets":[],"limits":[]}', "no buckets"),
        ('{"buckets":[[0,true]],"limits":[8]}', "True"),
        ('{"buckets":[[0]],"limits":[2.5]}', "2.5"),
        ('{"buckets":[[0]],"limits":[8],"x":1}', "not a BucketPlan"),
        ('{"buckets":5,"limits":[8]}', "list of lists"),
        ("not json", "not JSON"),
    ],
)
def test_from_json_refuses_what_it_would_have_to_coerce(text: str, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        BucketPlan.from_json(text)
    assert needle in str(err.value)


def test_from_json_takes_text_only() -> None:
    with pytest.raises(TypeError, match="JSON text"):
        BucketPlan.from_json(123)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "error", "needle"),
    [
        (-1, ValueError, "bucket_cap_mb = -1"),
        (-0.5, ValueError, "bucket_cap_mb = -0.5"),
        (float("nan"), ValueError, "bucket_cap_mb = nan"),
        (float("inf"), ValueError, "bucket_cap_mb = inf"),
        ("25", TypeError, "bucket_cap_mb must be a number"),
        (True, TypeError, "bucket_cap_mb must be a number"),
    ],
)
def test_cap_errors_name_the_argument(value: object, error: type, needle: str) -> None:
    with pytest.raises(error) as err:
        cap_mb_to_bytes(value)
    assert needle in str(err.value)


def test_cap_conversion() -> None:
    assert cap_mb_to_bytes(25) == 25 * 1024 * 1024
    assert cap_mb_to_bytes(1e-12, "first_bucket_cap_mb") == 1
    with pytest.raises(ValueError, match="first_bucket_cap_mb = -2"):
        cap_mb_to_bytes(-2, "first_bucket_cap_mb")
