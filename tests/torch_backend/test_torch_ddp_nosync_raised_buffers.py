"""A ``no_sync`` forward pass that raises in the module, with buffers: the next step works.

Two gloo ranks, a DDP over ``Linear`` and ``BatchNorm1d`` (buffers broadcast at each
forward pass after a synchronised one), each iteration a ``no_sync`` pass then a
synchronised one. Rank 0's ``no_sync`` forward pass of iteration 1 raises in the module:
that pass never reached its end, which sets whether the next pass syncs the buffers, so
rank 0 kept its synchronised pass's "sync" while rank 1 kept "don't". At iteration 2
rank 0 broadcast the buffers and rank 1 did not: rank 1's process aborted in gloo (exit
-6) outside ``join()``, and under ``Join`` the join all-reduce timed out. Now the first
pass after a failed step syncs the buffers on every rank: the step works, and the
replicas start it with the same buffers.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from ranks import every_rank_ok
from torch import nn

CONTEXTS = ("plain", "ddp.join()", "Join([ddp])")


def _run(rank: int, world: int) -> dict[str, Any]:
    from xgrad.failure_errors import RankError
    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    out: dict[str, Any] = {}
    for name in CONTEXTS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        armed = [False]
        at = [(0, 0)]  # the pass under way: (iteration, pass)
        seen: dict[str, list[float]] = {}  # running_mean as the module starts, per pass

        def pre(
            module: nn.Module,
            inputs: object,
            armed: list[bool] = armed,
            at: Any = at,
            seen: dict[str, list[float]] = seen,
        ) -> None:
            seen[str(at[0])] = module[1].running_mean.tolist()  # type: ignore[index]
            if armed[0]:
                armed[0] = False
                raise ValueError("boom")

        model.register_forward_pre_hook(pre)
        ddp = DistributedDataParallel(model, timeout=3.0)
        context: Any = {
            "plain": contextlib.nullcontext,
            "ddp.join()": ddp.join,
            "Join([ddp])": lambda ddp=ddp: Join([ddp]),
        }[name]
        steps: list[str | None] = []
        g = torch.Generator().manual_seed(100 + rank)
        with context():
            for i in range(3):
                try:
                    for k in range(2):
                        x = torch.randn(5, 4, generator=g)
                        armed[0] = rank == 0 and i == 1 and k == 0
                        at[0] = (i, k)
                        with ddp.no_sync() if k == 0 else contextlib.nullcontext():
                            ddp(x).square().mean().backward()
                    steps.append(None)
                except RankError as exc:
                    steps.append(str(exc).splitlines()[0])
        out[name] = {"steps": steps, "seen": seen}
    return out


def test_the_step_after_a_raising_no_sync_pass_syncs_the_buffers_on_every_rank() -> None:
    results = every_rank_ok(_run, 2, timeout=90)
    for name in CONTEXTS:
        for rank in range(2):
            steps = results[rank][name]["steps"]
            assert steps[0] is None and steps[2] is None, (name, rank, steps)
            assert steps[1] is not None and "rank 0 in forward: ValueError: boom" in steps[1]
        # iteration 2's first pass, synced from rank 0 on both: the same buffers
        first = [results[rank][name]["seen"][str((2, 0))] for rank in range(2)]
        assert first[0] == first[1], (name, first)
