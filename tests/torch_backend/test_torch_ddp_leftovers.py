"""A failed DDP step does not grow the store: its keys go once every rank has read them.

Each failed step used to leave its failure tickets in its namespace, and the fresh
private group made after it the addresses c10d wrote to make it (one key per rank), for
the rest of the run: a loop that catches the error and goes on grew the store by 5 keys
a failure on three ranks. Counted with the store's own ``num_keys`` on three real gloo
ranks, failures in a comm hook and in a forward pass, each followed by good steps.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ranks import key_count, run_ranks

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}


def _steps(rank: int, world: int, rounds: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update(FAST)
    warnings.simplefilter("ignore")  # the step after a failure warns what it dropped
    store = dist.distributed_c10d._get_default_store()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(4 * world, 5, generator=g), torch.randn(4 * world, 2, generator=g)
    ref = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    ref.load_state_dict(model.state_dict())
    ((ref(x) - y) ** 2).mean().backward()
    expected = [p.grad for p in ref.parameters()]
    xs, ys = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]
    fail = [""]

    def hook(
        state: Any, bucket: torch.distributed.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        if fail[0] == "hook" and rank == 1:
            raise ValueError("boom in hook")
        return allreduce_hook(state, bucket)

    def forward_fault(module: Any, inputs: Any) -> None:
        if fail[0] == "forward" and rank == 2:
            raise RuntimeError("boom in forward")

    ddp = DistributedDataParallel(model, timeout=6.0)
    ddp.register_comm_hook(None, hook)
    model[0].register_forward_pre_hook(forward_fault)

    def step(kind: str = "") -> str:
        fail[0] = kind
        model.zero_grad()
        try:
            ((ddp(xs) - ys) ** 2).mean().backward()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        good = all(
            torch.allclose(p.grad, e, atol=1e-6)
            for p, e in zip(model.parameters(), expected, strict=True)
        )
        return "" if good else "wrong gradients"

    out: dict[str, Any] = {"clean": [step(), step()], "failed": [], "after": []}
    out["baseline"] = key_count(store)
    for i in range(rounds):
        out["failed"].append(step(("hook", "forward")[i % 2]))
        # The step after a failure needs every rank (its reduction): by the next one's
        # start each rank has read the failure and marked it, and the lowest deletes.
        out["clean"] += [step(), step()]
        out["after"].append(key_count(store))
    return out


def test_failed_steps_leave_no_keys_once_every_rank_read_them() -> None:
    rounds = 4
    results, codes = run_ranks(_steps, 3, (rounds,), timeout=120)
    assert set(codes.values()) == {0}, (codes, results)
    for rank, (status, out) in sorted(results.items()):
        assert status == "ok", (rank, out)
        assert out["clean"] == [""] * len(out["clean"]), (rank, out)  # full-batch gradients
        assert all("boom in hook" in e for e in out["failed"][::2]), (rank, out)
        assert all("boom in forward" in e for e in out["failed"][1::2]), (rank, out)
        # What good steps hold (heartbeats, the private group's first addresses), and
        # nothing of the failed steps (was 5 more keys a failure).
        assert out["after"] == [out["baseline"]] * rounds, (rank, out)
