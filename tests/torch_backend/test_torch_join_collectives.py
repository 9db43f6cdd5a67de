"""Under xgrad's own ``join()`` a step sends two collectives of its own, as PyTorch's DDP does.

PyTorch's DDP under ``join()`` sends per forward pass its "not joined" all-reduce and
tells the joined ranks at the backward pass that one follows. xgrad's sent three: the
"not joined" count, the announcement (every rank's flags: :mod:`.join_announce`) and the
round (:mod:`.join_rounds`). Under xgrad's own ``Join`` the announcement rides in the
count (one tensor: the count and every rank's flags); under PyTorch's ``Join``, whose
count is one element, it is still sent on its own. Counted here as the all-reduces a
synchronised step launches (every one goes through the process group's ``allreduce``),
less those of the same step outside ``join()``; the gradients are the same in all three.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from xgrad.torch_backend.spawn import spawn

STEPS = 5


def _counts(rank: int, world: int) -> dict[str, Any]:
    """Per context: the all-reduces each step launched, and its gradients."""
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join as TorchJoin

    from xgrad.torch_backend import DistributedDataParallel

    launched = [0]
    allreduce = dist.ProcessGroup.allreduce

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        launched[0] += 1
        return allreduce(self, *args, **kwargs)

    dist.ProcessGroup.allreduce = counted  # type: ignore[method-assign]
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))  # no buffers to sync
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, 5, generator=g) for _ in range(STEPS)]
    out: dict[str, Any] = {}
    for name in ("none", "join", "torch_join"):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, timeout=6.0)
        # (one context made per DDP: each sets the DDP's join config, the last one wins)
        ctx = TorchJoin([ddp]) if name == "torch_join" else ddp.join(enable=name == "join")
        counts, grads = [], []
        with ctx:
            for x in batches:
                model.zero_grad()
                before = launched[0]
                ddp(x).square().sum().backward()
                counts.append(launched[0] - before)
                grads.append([p.grad.clone().numpy() for p in model.parameters()])
        out[name] = {"counts": counts, "grads": grads}
    out["two"] = _two_ddps(rank, base)
    return out


def _two_ddps(rank: int, base: nn.Module) -> dict[str, Any]:
    """Two DDPs in one xgrad ``Join``, uneven inputs (rank ``r`` has ``2 + 2 r``
    batches): the first one's announcement rides in the count, the second's goes on its
    own; the gradients of both and PyTorch's DDPs in PyTorch's ``Join``."""
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    g = torch.Generator().manual_seed(10 + rank)
    batches = [torch.randn(4, 5, generator=g) for _ in range(2 + 2 * rank)]
    out = {}
    for name in ("xgrad", "torch"):
        models = [copy.deepcopy(base), copy.deepcopy(base)]
        if name == "xgrad":
            ddps: list[Any] = [DistributedDataParallel(m, timeout=6.0) for m in models]
            ctx: Any = Join(ddps)
        else:
            ddps = [TorchDDP(m) for m in models]
            ctx = TorchJoin(ddps)
        grads = []
        with ctx:
            for x in batches:
                for ddp, model in zip(ddps, models, strict=True):
                    model.zero_grad()
                    ddp(x).square().sum().backward()
                grads.append([p.grad.clone().numpy() for m in models for p in m.parameters()])
        out[name] = grads
    return out


@pytest.fixture(scope="module")
def counts() -> list[dict[str, Any]]:
    return spawn(_counts, 2, timeout=60)


@pytest.mark.parametrize(("context", "extra"), [("join", 2), ("torch_join", 3)])
def test_a_step_under_xgrads_join_sends_two_collectives_of_its_own(
    counts: list[dict[str, Any]], context: str, extra: int
) -> None:
    for rank, result in enumerate(counts):
        # from the third step on: the first two also agree and rebuild the buckets
        plain = result["none"]["counts"][2:]
        joined = result[context]["counts"][2:]
        assert len(set(plain)) == 1, (rank, result["none"]["counts"])
        assert [n - plain[0] for n in joined] == [extra] * len(joined), (rank, result)
        for step, (ours, theirs) in enumerate(
            zip(result[context]["grads"], result["none"]["grads"], strict=True)
        ):
            for a, b in zip(ours, theirs, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=f"{rank} {step}")


def test_a_second_ddp_in_the_same_join_trains_as_pytorchs(counts: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(counts):
        ours, theirs = result["two"]["xgrad"], result["two"]["torch"]
        assert len(ours) == 2 + 2 * rank, (rank, len(ours))
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            for x, y in zip(a, b, strict=True):
                np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6, err_msg=f"{rank} {step}")
