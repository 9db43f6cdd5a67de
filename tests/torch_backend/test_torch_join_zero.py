"""``Join([ddp, optimizer])`` with PyTorch's ``ZeroRedundancyOptimizer``: PyTorch's uneven-inputs recipe.

PyTorch's tutorial on uneven inputs joins a DDP and a ``ZeroRedundancyOptimizer`` (a
``Joinable`` too: its join hook takes part in the shards' broadcasts of each
``step()``) in one context. Gloo ranks, each with a different number of batches
(rank ``r`` has ``2 + 2r``), train the same model three ways: PyTorch's DDP under
PyTorch's ``Join``, which is the reference, and xgrad's DDP under PyTorch's ``Join``
and under xgrad's own. xgrad's must end with PyTorch's parameters and buffers bit for
bit, on every rank: its join hook and the optimizer's share the context's count, and
its shadow pass must pair with the ranks still training whichever context counts.
"""

from __future__ import annotations

from typing import Any

import pytest
from ranks import every_rank_ok


def _train(rank: int, world: int) -> dict[str, Any]:
    import copy

    import torch
    from torch import nn
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    out: dict[str, Any] = {}
    for model_name in ("mlp", "batchnorm"):
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)]
        if model_name == "batchnorm":
            layers.insert(1, nn.BatchNorm1d(8))
        base = nn.Sequential(*layers)
        for side in ("torch", "xgrad under PyTorch's Join", "xgrad under xgrad's Join"):
            model = copy.deepcopy(base)
            ddp = TorchDDP(model) if side == "torch" else DistributedDataParallel(model)
            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9
            )
            context = Join if side.endswith("xgrad's Join") else TorchJoin
            g = torch.Generator().manual_seed(rank)
            with context([ddp, opt]):
                for _ in range(2 + 2 * rank):
                    opt.zero_grad()
                    ddp(torch.randn(3, 4, generator=g)).square().mean().backward()
                    opt.step()
            out[f"{model_name}, {side}"] = [t.detach().clone() for t in model.state_dict().values()]
    return out


@pytest.fixture(scope="module", params=[2, 3])
def trained(request: pytest.FixtureRequest) -> dict[int, Any]:
    return every_rank_ok(_train, request.param, timeout=120)


@pytest.mark.parametrize("model", ["mlp", "batchnorm"])
@pytest.mark.parametrize("context", ["PyTorch's Join", "xgrad's Join"])
def test_xgrad_ends_with_pytorchs_parameters_and_buffers(
    trained: dict[int, Any], model: str, context: str
) -> None:
    import torch

    for rank, result in trained.items():
        want, got = result[f"{model}, torch"], result[f"{model}, xgrad under {context}"]
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (rank, model, context, i, (a - b).abs().max())
        # and every rank ends with the same model (a rank that joined last's)
        assert all(
            torch.equal(a, b)
            for a, b in zip(got, trained[0][f"{model}, xgrad under {context}"], strict=True)
        )
