"""A user's gradient hook that raises on one rank: every peer hears what it raised.

The pass is cut short inside autograd, where DDP's hooks never see the exception; the
peers' error named the rank and said only "the backward pass raised an exception". Now
it carries the exception's type and text (bounded), as a forward pass's failure does,
the rank that raised keeps its own exception, and the next step is right on every rank.
On real gloo ranks, with the hook on a parameter and on an activation.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
from ranks import run_ranks
from steps import grads_are, recorded

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
SHARD = 4
#: step -> the text rank 1's hook raises at it.
FAULTS = {1: "boom 42", 3: "x" * 100_000}


def _steps(rank: int, world: int, on: str) -> list[dict[str, Any]]:
    """Five steps of one DDP; rank 1's hook (on ``on``: a parameter, an activation)
    raises a ValueError at the steps of :data:`FAULTS`."""
    import torch
    from torch import nn

    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update(FAST)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(SHARD * world, 5, generator=g), torch.randn(SHARD * world, 2, generator=g)
    ref = copy.deepcopy(model)
    ((ref(x) - y) ** 2).mean().backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}
    step = [0]

    def fault(grad: Any) -> Any:
        if rank == 1 and step[0] in FAULTS:
            raise ValueError(FAULTS[step[0]])
        return grad

    def hook_activation(module: Any, inputs: Any, output: Any) -> None:
        output.register_hook(fault)

    if on == "param":
        model[0].weight.register_hook(fault)
    else:
        model[0].register_forward_hook(hook_activation)
    ddp = DistributedDataParallel(model, timeout=20)
    xs, ys = x[rank * SHARD : (rank + 1) * SHARD], y[rank * SHARD : (rank + 1) * SHARD]
    out = []
    for s in range(5):
        step[0] = s
        model.zero_grad()
        record: dict[str, Any] = {"error": ""}

        def body(record: dict[str, Any] = record) -> None:
            ((ddp(xs) - ys) ** 2).mean().backward()
            record["correct"] = grads_are(model, expected)

        out.append(recorded(record, body))
    return out


@pytest.mark.parametrize(("world", "on"), [(2, "param"), (3, "activation")])
def test_a_users_hook_that_raises_is_named_with_its_text_on_every_rank(world: int, on: str) -> None:
    results, codes = run_ranks(_steps, world, (on,), timeout=120)
    assert all(c == 0 for c in codes.values()), (codes, results)
    steps = {}
    for rank, (status, value) in results.items():
        assert status == "ok", value
        steps[rank] = value
    assert steps[1][1]["error"] == "ValueError: boom 42"  # its own exception, as it was
    for rank in (r for r in range(world) if r != 1):
        error = steps[rank][1]["error"]
        assert error == "RankError: rank 1 in backward: ValueError: boom 42", error
        assert steps[rank][1]["origin"] == 1
        assert steps[rank][1]["seconds"] < 5.0, steps[rank][1]
        long = steps[rank][3]["error"]  # the peers read 2000 characters of "ValueError: xx..."
        assert long.startswith("RankError: rank 1 in backward: ValueError: xxx"), long[:80]
        left_out = len("ValueError: ") + len(FAULTS[3]) - 2000
        assert long.endswith(f"x... ({left_out} more characters)"), long[-80:]
    for rank in range(world):
        for s in (0, 2, 4):
            assert steps[rank][s]["error"] == "", (rank, steps[rank][s])
            assert steps[rank][s]["correct"], (rank, s)
