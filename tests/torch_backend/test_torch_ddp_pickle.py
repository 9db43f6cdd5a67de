"""``copy.deepcopy`` and pickling of xgrad's DDP, against PyTorch's DDP (2 gloo processes).

PyTorch's DDP may be deep-copied and pickled over the default group; the copy reduces
over its own module from then on. Both wrappers train two steps, are copied, and the
copies train on: gradients equal PyTorch's copies bit for bit.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn


def _train(ddp: nn.Module, rank: int, steps: int) -> list[list[torch.Tensor]]:
    grads = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        ddp.zero_grad(set_to_none=True)
        ddp(torch.randn(4, 5, generator=g)).square().sum().backward()
        grads.append([p.grad.clone() for p in ddp.parameters() if p.grad is not None])
    return grads


def _copies(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.BatchNorm1d(8), nn.Linear(8, 2))
    ours = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.0001)
    theirs = TorchDDP(copy.deepcopy(base), bucket_cap_mb=0.0001)
    for wrapper in (ours, theirs):
        _train(wrapper, rank, 2)
    for how, clone in (
        ("deepcopy", copy.deepcopy),
        ("pickle", lambda d: pickle.loads(pickle.dumps(d))),
    ):
        copies = [clone(ours), clone(theirs)]
        out[how] = {
            "type": type(copies[0]) is DistributedDataParallel,
            "own module": copies[0].module is not ours.module,
            "grads": [_train(d, rank, 3) for d in copies],
        }
    # A static graph stays static. (PyTorch's own copy of a static-graph DDP gives other
    # gradients than the original goes on to give, so the reference is the original.)
    static = DistributedDataParallel(copy.deepcopy(base), static_graph=True)
    _train(static, rank, 2)
    duplicate = copy.deepcopy(static)
    out["static"] = (duplicate.static_graph, _train(duplicate, rank, 2), _train(static, rank, 2))
    group = torch.distributed.new_group([0, 1])
    try:
        pickle.dumps(DistributedDataParallel(copy.deepcopy(base), process_group=group))
        out["other group"] = "pickled"
    except RuntimeError as err:
        out["other group"] = str(err)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_copies, 2, timeout=120)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_trains_like_pytorchs_copy(results: list[dict[str, Any]], how: str) -> None:
    for r in results:
        assert r[how]["type"] and r[how]["own module"]
        ours, theirs = r[how]["grads"]
        for step, (mine, ref) in enumerate(zip(ours, theirs, strict=True)):
            assert len(mine) == len(ref) == 6
            assert all(map(torch.equal, mine, ref)), f"{how} step {step}"


def test_a_copy_of_a_static_graph_trains_like_the_original(results: list[dict[str, Any]]) -> None:
    for r in results:
        is_static, duplicate, original = r["static"]
        assert is_static
        for mine, ref in zip(duplicate, original, strict=True):
            assert all(map(torch.equal, mine, ref))


def test_only_the_default_group_pickles(results: list[dict[str, Any]]) -> None:
    assert (
        "only supported when using DDP with the default process group"
        in (results[0]["other group"])
    )
