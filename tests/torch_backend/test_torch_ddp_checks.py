"""Bad DDP arguments refused by name, and ranks that disagree on the plan stopped, on real gloo ranks.

One spawned group of two ranks runs every case and returns the messages; every
disagreement must raise on both ranks (no hang, no SIGABRT, no silently wrong gradients).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from xgrad.buckets import BucketPlan
from xgrad.torch_backend.ddp_checks import TIMEOUT_ENV, resolve_timeout
from xgrad.torch_backend.spawn import spawn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # four tensors: 64, 16, 64, 16 B


def _step(ddp: nn.Module) -> None:
    ddp(torch.ones(2, 4)).sum().backward()


def _cases(rank: int, world: int) -> dict[str, str]:
    from xgrad.agreement import DisagreementError
    from xgrad.torch_backend import DistributedDataParallel

    out: dict[str, str] = {}

    def attempt(name: str, build: Any, step: bool = True) -> None:
        try:
            ddp = build()
            if step:
                _step(ddp)
            out[name] = "accepted"
        except (TypeError, ValueError) as err:
            tag = "Disagreement" if isinstance(err, DisagreementError) else type(err).__name__
            out[name] = f"{tag}: {err}"

    attempt("timeout_nan", lambda: DistributedDataParallel(_model(), timeout=float("nan")), False)
    attempt("timeout_inf", lambda: DistributedDataParallel(_model(), timeout=float("inf")), False)
    attempt("timeout_zero", lambda: DistributedDataParallel(_model(), timeout=0), False)
    attempt("plan_str", lambda: DistributedDataParallel(_model(), plan='{"buckets":[[0]]}'), False)  # type: ignore[arg-type]
    # Refused only where PyTorch's bucket assignment refuses it (test_torch_ddp_caps).
    attempt(
        "cap",
        lambda: DistributedDataParallel(_model(), bucket_cap_mb=-1, find_unused_parameters=True),
        False,
    )
    attempt("first_cap", lambda: DistributedDataParallel(_model(), first_bucket_cap_mb=-2), False)
    meta = nn.Linear(3, 3, device="meta")
    attempt("meta", lambda: DistributedDataParallel(meta), False)
    # Same sizes, parameters in another order on rank 1: silently wrong without the check.
    swapped = ((0, 1), (2, 3)) if rank == 0 else ((2, 1), (0, 3))
    attempt(
        "swapped", lambda: DistributedDataParallel(_model(), plan=BucketPlan(swapped, (80, 80)))
    )
    # A different number of buckets per rank (SIGABRT in gloo without the check).
    count = ((0, 1, 2, 3),) if rank == 0 else ((0, 1), (2, 3))
    limits = (160,) if rank == 0 else (80, 80)
    attempt("count", lambda: DistributedDataParallel(_model(), plan=BucketPlan(count, limits)))
    # Per-rank caps with find_unused_parameters (no rebuild: the plans stay different).
    cap = 25 if rank == 0 else 50 / 1024 / 1024
    attempt(
        "caps",
        lambda: DistributedDataParallel(_model(), bucket_cap_mb=cap, find_unused_parameters=True),
    )

    # A comm hook on one rank only.
    def hooked() -> nn.Module:
        ddp = DistributedDataParallel(_model())
        if rank == 1:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp

    attempt("hook", hooked)
    attempt("agreeing", lambda: DistributedDataParallel(_model()))
    return out


@pytest.fixture(scope="module")
def cases() -> list[dict[str, str]]:
    return spawn(_cases, 2, timeout=120)


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("timeout_nan", "ValueError: timeout = nan"),
        ("timeout_inf", "ValueError: timeout = inf"),
        ("timeout_zero", "ValueError: timeout = 0"),
        ("plan_str", "TypeError: plan must be a BucketPlan, got str"),
        ("cap", "TypeError: bucket_cap_mb = -1 is -1048576 bytes"),
        ("first_cap", "ValueError: first_bucket_cap_mb = -2"),
        ("meta", "ValueError: parameters on the meta device have no data to reduce: weight, bias"),
    ],
)
def test_bad_arguments_are_refused_by_name(
    cases: list[dict[str, str]], case: str, needle: str
) -> None:
    for result in cases:
        assert result[case].startswith(needle), result[case]


def test_same_sizes_in_another_order_raise_on_every_rank_naming_bucket_and_parameters(
    cases: list[dict[str, str]],
) -> None:
    for rank, result in enumerate(cases):
        message = result["swapped"]
        assert message.startswith("Disagreement: DistributedDataParallel: the ranks disagree"), (
            message
        )
        assert f"seen on rank {rank}" in message and "rank 1 differ from rank 0" in message
        assert "bucket 0 differs: rank 0 has '[0, 1] = (0.weight, 0.bias)" in message
        assert "rank 1 has '[2, 1] = (1.weight, 0.bias)" in message


def test_a_different_number_of_buckets_or_caps_or_hooks_raise_on_every_rank(
    cases: list[dict[str, str]],
) -> None:
    for result in cases:
        assert "bucket 0 differs" in result["count"], result["count"]
        assert "bucket 0 differs" in result["caps"], result["caps"]
        assert "hook 0 differs: rank 0 has 'allreduce (default)', rank 1 has" in result["hook"]
        assert "fp16_compress_hook" in result["hook"]
        assert result["agreeing"] == "accepted"


def test_timeout_default_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert resolve_timeout(None) == 300.0
    monkeypatch.setenv(TIMEOUT_ENV, "12.5")
    assert resolve_timeout(None) == 12.5
    assert resolve_timeout(3) == 3.0
    assert resolve_timeout(timedelta(minutes=2)) == 120.0  # torch's form of a timeout
    monkeypatch.setenv(TIMEOUT_ENV, "nan")
    with pytest.raises(ValueError, match="XGRAD_DDP_TIMEOUT = nan"):
        resolve_timeout(None)
    with pytest.raises(TypeError, match="timeout must be a number of seconds, got '5'"):
        resolve_timeout("5")
