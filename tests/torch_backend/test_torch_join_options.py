"""``ddp.join()`` under each DDP option, bit for bit against PyTorch's DDP under its own ``join()``.

Three gloo ranks with 2, 4 and 5 batches train the same model (SGD with momentum) with
xgrad's DDP and with PyTorch's, each inside its own ``ddp.join()``, under one option at a
time: gradients as bucket views, many small buckets, the fp16 communication hook,
activation checkpointing (and reentrant checkpointing with ``static_graph``),
``divide_by_initial_world_size=False``, BatchNorm buffers broadcast or not,
``find_unused_parameters`` with a parameter never used, ``static_graph``, a ``no_sync``
pass before each step, and ``zero_grad(set_to_none=True)``. Every step's gradients and
the final parameters and buffers must be PyTorch's, bit for bit, on every rank: the
joined ranks' shadow pass enters what each option makes the ranks still training send
(buckets, the hook's casts, the unused map, the buffers' broadcast) as PyTorch's does.
"""

from __future__ import annotations

from typing import Any

import pytest
from ranks import every_rank_ok

CASES = {
    "plain": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "small buckets": {"bucket_cap_mb": 0.0005},
    "fp16 hook": {},
    "checkpoint": {},
    "reentrant checkpoint, static_graph": {"static_graph": True},
    "divide_by_initial_world_size=False": {},
    "batchnorm": {},
    "batchnorm, broadcast_buffers=False": {"broadcast_buffers": False},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "no_sync pass first": {},
    "set_to_none": {},
}
BATCHES = (2, 4, 5)


def _train(rank: int, world: int) -> dict[str, Any]:
    import copy

    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torch.utils.checkpoint import checkpoint

    from xgrad.torch_backend import DistributedDataParallel

    class Model(nn.Module):
        def __init__(self, case: str) -> None:
            super().__init__()
            self.case = case
            self.a = nn.Linear(6, 16)
            self.norm = nn.BatchNorm1d(16) if case.startswith("batchnorm") else nn.Identity()
            self.b = nn.Linear(16, 16)
            self.c = nn.Linear(16, 3)
            self.unused = nn.Linear(3, 3)  # trained only where find_unused_parameters is on
            self.unused.requires_grad_(case == "find_unused_parameters")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.norm(self.a(x)))
            if "checkpoint" in self.case:
                reentrant = self.case.startswith("reentrant")
                h = checkpoint(self.b, h, use_reentrant=reentrant)
            else:
                h = self.b(h)
            return self.c(torch.tanh(h))

    out: dict[str, Any] = {}
    for case, kwargs in CASES.items():
        torch.manual_seed(0)
        base = Model(case)
        for side, cls in (("torch", TorchDDP), ("xgrad", DistributedDataParallel)):
            model = copy.deepcopy(base)
            ddp = cls(model, **kwargs)
            if case == "fp16 hook":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
            divide = case != "divide_by_initial_world_size=False"
            g = torch.Generator().manual_seed(rank)
            steps = []
            with ddp.join(divide_by_initial_world_size=divide):
                for _ in range(BATCHES[rank]):
                    opt.zero_grad(set_to_none=case == "set_to_none")
                    if case == "no_sync pass first":
                        with ddp.no_sync():
                            ddp(torch.randn(4, 6, generator=g)).square().mean().backward()
                    ddp(torch.randn(4, 6, generator=g)).square().mean().backward()
                    steps.append([None if p.grad is None else p.grad.clone() for p in params])
                    opt.step()
            state = [t.detach().clone() for t in model.state_dict().values()]
            out[f"{case}, {side}"] = (steps, state)
    return out


@pytest.fixture(scope="module")
def trained() -> dict[int, Any]:
    return every_rank_ok(_train, len(BATCHES), timeout=240)


@pytest.mark.parametrize("case", list(CASES))
def test_xgrad_trains_as_pytorch_under_join(trained: dict[int, Any], case: str) -> None:
    import torch

    for rank, result in trained.items():
        (ours, our_state), (theirs, their_state) = (
            result[f"{case}, xgrad"],
            result[f"{case}, torch"],
        )
        assert len(ours) == len(theirs) == BATCHES[rank]
        for i, (got, want) in enumerate(zip(ours, theirs, strict=True)):
            for j, (a, b) in enumerate(zip(got, want, strict=True)):
                same = (a is None and b is None) or (
                    a is not None and b is not None and torch.equal(a, b)
                )
                assert same, (case, rank, "step", i, "gradient", j)
        for j, (a, b) in enumerate(zip(our_state, their_state, strict=True)):
            assert torch.equal(a, b), (case, rank, "state entry", j)
