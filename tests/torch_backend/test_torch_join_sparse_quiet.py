"""``join()`` on a model with a sparse gradient prints no warning of torch's.

A joined rank offers an empty sparse gradient to the sparse bucket's reduction. Made
without saying whether torch should check its invariants, that empty tensor made torch
print, once per process, "Sparse invariant checks are implicitly disabled": a warning
about the user's code that the user never wrote. Each rank here is a fresh process, so
the one-time warning would show in the first joined step.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from ranks import every_rank_ok
from torch import nn


def _joined_sparse(rank: int, world: int) -> list[str]:
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(10, 4, mode="sum", sparse=True), nn.Linear(4, 1))
    ddp = DistributedDataParallel(model, timeout=10)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 10, (3, 2), generator=g) for _ in range(1 + 2 * rank)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with ddp.join():
            for batch in batches:
                ddp(batch).sum().backward()
    return [str(w.message) for w in seen]


def test_a_joined_rank_shadowing_a_sparse_bucket_prints_no_warning() -> None:
    said: dict[int, Any] = every_rank_ok(_joined_sparse, 2, timeout=60)
    assert said == {0: [], 1: []}, said
