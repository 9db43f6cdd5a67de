"""``Join([ddp, optimizer])`` with iterations of more than one forward pass, or a failed one.

PyTorch's ``Join`` runs the ``ZeroRedundancyOptimizer``'s join hook (a step, then the
broadcast of every shard) once per count of the ranks still training, and a DDP counts
at each forward pass: with a ``no_sync`` pass before each synchronised one, or an
evaluation under ``torch.no_grad()``, a joined rank stepped twice per iteration and its
broadcasts met the next collectives of the ranks still training (PyTorch's DDP under
PyTorch's ``Join`` waits there for gloo's timeout; xgrad's raised a 5 s timeout naming
the wrong rank). Under xgrad's ``Join`` the optimizer's hook now runs once per step of
the DDP (:mod:`xgrad.torch_backend.join_others`), and not in an iteration whose step
failed and which the ranks still training give up, optimizer step included.

Gloo ranks with 2, 4 and 6 batches train with SGD with momentum, xgrad's DDP under
xgrad's ``Join([ddp, opt])``, against PyTorch's DDP under PyTorch's ``Join`` running the
same iterations as one synchronised pass each:

* ``no_sync``: two halves of the batch, a ``no_sync`` pass then a synchronised one,
  against one pass over the whole batch (the loss the sum of the halves' losses);
* ``evaluation``: an evaluation under ``torch.no_grad()``, then the training pass, against
  the training pass alone;
* ``failed``: the last rank's forward pass raises at iteration 2 (when rank 0 has joined),
  every rank still training catches it and skips the iteration (rank 0 raises it as it
  leaves ``join()``), against every rank skipping iteration 2 (its batch drawn and left).
"""

from __future__ import annotations

from typing import Any

import pytest
from ranks import every_rank_ok

SCENARIOS = ("no_sync", "evaluation", "failed")
AT = 2


def _train(rank: int, world: int) -> dict[str, Any]:
    import copy

    import torch
    from torch import nn
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.failure_errors import RankError
    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    def loss(out: torch.Tensor) -> torch.Tensor:  # a sum over the two halves' mean losses
        return out[:3].square().mean() + out[3:].square().mean()

    armed = [False]

    def boom(module: Any, inputs: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise ValueError("boom")

    out: dict[str, Any] = {}
    for scenario in SCENARIOS:
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

        for side in ("xgrad", "torch"):
            model = copy.deepcopy(base)
            model.register_forward_pre_hook(boom)
            ddp = (
                DistributedDataParallel(model, timeout=5.0) if side == "xgrad" else TorchDDP(model)
            )
            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9
            )
            g = torch.Generator().manual_seed(rank)
            raised = []
            try:
                with (Join if side == "xgrad" else TorchJoin)([ddp, opt]):
                    for i in range(2 + 2 * rank):
                        x = torch.randn(6, 4, generator=g)
                        failing = scenario == "failed" and i == AT
                        if side == "torch":
                            if not failing:
                                opt.zero_grad()
                                loss(ddp(x)).backward()
                                opt.step()
                            continue
                        try:
                            opt.zero_grad()
                            if scenario == "no_sync":
                                with ddp.no_sync():
                                    ddp(x[:3]).square().mean().backward()
                                ddp(x[3:]).square().mean().backward()
                            else:
                                if scenario == "evaluation":
                                    with torch.no_grad():
                                        ddp(x)
                                armed[0] = failing and rank == world - 1
                                loss(ddp(x)).backward()
                            opt.step()
                        except RankError as exc:
                            raised.append((i, str(exc).splitlines()[0]))
            except RankError as exc:  # a rank that had joined: the step's failure, as it leaves
                raised.append((-1, str(exc).splitlines()[0]))
            state = [p.detach().clone() for p in model.parameters()]
            out[f"{scenario}, {side}"] = (state, raised)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def trained(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    return request.param, every_rank_ok(_train, request.param, timeout=120)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_optimizer_steps_once_per_step(
    trained: tuple[int, dict[int, Any]], scenario: str
) -> None:
    import torch

    world, results = trained
    for rank, result in results.items():
        (ours, raised), (theirs, _) = result[f"{scenario}, xgrad"], result[f"{scenario}, torch"]
        for j, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            # the halves' gradients are summed in another order than the whole batch's
            torch.testing.assert_close(
                a, b, rtol=1e-6, atol=1e-7, msg=f"{scenario} rank {rank} {j}"
            )
        boom = f"rank {world - 1} in forward: ValueError: boom"
        if scenario == "failed":  # raised at the step, or as it leaves join() (joined before)
            assert raised == [(AT if 2 + 2 * rank > AT else -1, boom)], raised
        else:
            assert raised == [], raised
