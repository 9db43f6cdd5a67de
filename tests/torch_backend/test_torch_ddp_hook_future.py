"""A comm hook whose future never completes, on one of two gloo ranks.

Rank 1's hook returns a future it never sets (its all-reduce never launched); rank 0's
all-reduce runs out gloo's timeout. Every rank must name rank 1. Before, rank 0 stopped
publishing its wait as soon as its collective failed, before it had worded the failure,
and rank 1, timing out the same moment, could read that and name rank 0 as the live rank
late for the collective (the roles inverted; seen in a probe's runs with other timings,
not reproduced reliably here). A hook's future now publishes its wait until the failure is
worded, as a collective's wait did.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn


def _run(rank: int, world: int) -> list[Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ddp = DistributedDataParallel(model, timeout=3.0)
    armed = [False]

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # PyTorch checks annotations
        if armed[0] and rank == 1:
            return torch.futures.Future()  # never set
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    out: list[Any] = []
    for step in range(3):
        armed[0] = step == 1  # after a good step
        ddp.zero_grad(set_to_none=True)
        try:
            ddp(torch.ones(3, 4)).sum().backward()
            out.append("ok")
        except Exception as exc:
            out.append((getattr(exc, "rank", None), str(exc)))
    return out


def test_a_hook_future_that_never_completes_names_its_rank(monkeypatch: Any) -> None:
    monkeypatch.setenv("XGRAD_HEARTBEAT_INTERVAL", "0.2")  # waits published sooner
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = spawn(_run, 2, timeout=90)
    for rank, out in enumerate(results):
        assert out[0] == "ok" and out[2] == "ok", (rank, out)
        origin, text = out[1]
        assert origin == 1, (rank, text)
        assert text.startswith("rank 1 in comm hook hook, bucket 0: timed out"), (rank, text)
