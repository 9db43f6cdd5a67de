"""Agreement across ranks: the first difference named, on simulated ranks of the reference comm."""

from __future__ import annotations

from xgrad.agreement import (
    DisagreementError,
    Fingerprint,
    check_agreement,
    data_parallel_fingerprint,
    first_difference,
)
from xgrad.buckets import BucketPlan
from xgrad.reference.comm import ReferenceComm, spawn

PARAMS = [("w", (2, 3), "float32"), ("b", (3,), "float32")]


def _ddp(plan: BucketPlan, params=PARAMS, hook: str = "allreduce") -> Fingerprint:  # type: ignore[no-untyped-def]
    return data_parallel_fingerprint(plan, params, hook)


def test_same_fingerprints_agree_and_digest_is_stable() -> None:
    a = _ddp(BucketPlan(((1, 0),), (100,)))
    b = _ddp(BucketPlan(((1, 0),), (100,)))
    assert a.digest == b.digest and len(a.digest) == 64
    assert first_difference([a, b, a]) is None


def test_same_sizes_different_parameters_name_bucket_and_parameters() -> None:
    ref = _ddp(BucketPlan(((0,), (1,)), (24, 24)))
    swapped = _ddp(BucketPlan(((1,), (0,)), (24, 24)))
    message = first_difference([ref, ref, swapped])
    assert message is not None
    assert message.startswith("bucket 0 differs: ranks 0, 1 have '[0] = (w)")
    assert "rank 2 has '[1] = (b)" in message


def test_different_bucket_counts_and_hooks_and_params() -> None:
    one = _ddp(BucketPlan(((0, 1),), (100,)))
    two = _ddp(BucketPlan(((0,), (1,)), (24, 24)))
    assert first_difference([one, two]).startswith("bucket 0 differs")  # type: ignore[union-attr]
    short = Fingerprint.of("schedule", send=["0->1 mb0"])
    longer = Fingerprint.of("schedule", send=["0->1 mb0", "0->1 mb1"])
    assert first_difference([short, longer, longer]) == (
        "send 1 differs: rank 0 has '(nothing)', ranks 1, 2 have '0->1 mb1'"
    )
    hooked = _ddp(BucketPlan(((0, 1),), (100,)), hook="fp16_compress_hook")
    assert first_difference([one, hooked]) == (
        "hook 0 differs: rank 0 has 'allreduce', rank 1 has 'fp16_compress_hook'"
    )
    other = _ddp(BucketPlan(((0, 1),), (100,)), params=[PARAMS[0], ("b", (4,), "float32")])
    assert "parameter 1 differs" in str(first_difference([one, other]))
    assert "b shape [4] float32" in str(first_difference([one, other]))


def _check(prints: list[Fingerprint]):  # type: ignore[no-untyped-def]
    def body(comm: ReferenceComm) -> object:
        try:
            check_agreement(comm, prints[comm.rank], where="DDP")
        except DisagreementError as err:
            return err
        return None

    return body


def test_every_rank_raises_the_same_error_naming_ranks() -> None:
    ref = _ddp(BucketPlan(((0,), (1,)), (24, 24)))
    swapped = _ddp(BucketPlan(((1,), (0,)), (24, 24)))
    errors = spawn(_check([ref, swapped, ref]), 3, timeout=10)
    assert all(isinstance(e, DisagreementError) for e in errors)
    for rank, err in enumerate(errors):
        assert f"seen on rank {rank}" in str(err)
        assert "rank 1 differ from rank 0" in str(err)
        assert err.section == "bucket" and err.index == 0 and err.ranks == [1]
    assert spawn(_check([ref, ref, ref]), 3, timeout=10) == [None, None, None]


def test_agreement_costs_one_gather_when_ranks_agree() -> None:
    calls: list[int] = []

    def body(comm: ReferenceComm) -> None:
        real = comm.allgather_object

        def counted(obj: object) -> list[object]:
            calls.append(comm.rank)
            return real(obj)

        comm.allgather_object = counted  # type: ignore[method-assign]
        check_agreement(comm, _ddp(BucketPlan(((0, 1),), (100,))), where="DDP")

    spawn(body, 2, timeout=10)
    assert sorted(calls) == [0, 1]


def test_module_example() -> None:
    import doctest

    import xgrad.agreement

    assert doctest.testmod(xgrad.agreement).failed == 0
