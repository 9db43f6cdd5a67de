"""Two DDPs in xgrad's ``Join([d1, d2])``, ``d2`` forwarded once before ``d1``, then in order.

Gloo ranks; in the context, before any rank joined, every rank runs ``d2`` once under
``torch.no_grad()`` (out of the context's order, harmless: nobody shadows anything), then
each iteration ``d1``'s forward and backward passes, then ``d2``'s, in order. Rank 0 has
one batch, the others three; the ranks still training pause (``SLOW``, under the DDP's
timeout) after each iteration, so that rank 0, joined, counts past a poll of the store.

Before, the one pass out of order marked the context for good (:class:`~xgrad.torch_backend
.join_order.JoinOrder`'s ``wrong``): each later ``d2`` pass wrote the first DDP's step to the
store, and the joined rank, counting for the next iteration, read the step it had just
shadowed and refused the iteration (``ran DDP 1's forward pass before DDP 0's``) at once on
rank 0, the others then losing it. Now the note names ``d2``'s step too, and a joined rank
that shadowed that pass of ``d2`` already waits on: every rank trains as PyTorch's
``Join`` over its own DDPs does (its joined rank pairs nothing wrongly here either).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
from ranks import every_rank_ok

TIMEOUT = 3.0
SLOW = 0.6
BATCHES = lambda world: [1] + [3] * (world - 1)  # noqa: E731


def _contexts(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel
    from xgrad.torch_backend.join import Join

    torch.manual_seed(0)
    base = [nn.Linear(5, 5), nn.Linear(5, 2)]
    x = torch.arange(20.0).reshape(4, 5) * (rank + 1) / 10
    ours = [copy.deepcopy(m) for m in base]
    d1, d2 = (DistributedDataParallel(m, timeout=TIMEOUT) for m in ours)
    theirs = [copy.deepcopy(m) for m in base]
    t1, t2 = (TorchDDP(m) for m in theirs)
    out: dict[str, Any] = {}

    def run(name: str, ddps: Any, models: list[Any], ctx: Any) -> None:
        steps: list[Any] = []
        started = time.monotonic()
        try:
            with ctx:
                with torch.no_grad():
                    ddps[1](x)  # out of order, once, before any rank joined
                for _ in range(BATCHES(world)[rank]):
                    for m in models:
                        m.zero_grad()
                    for ddp in ddps:
                        ddp(x).square().sum().backward()
                    steps.append([p.grad.clone().numpy() for m in models for p in m.parameters()])
                    if rank:
                        time.sleep(SLOW)
            left = "left"
        except RuntimeError as exc:
            left = f"{type(exc).__name__}: {exc}"
        out[name] = {"steps": steps, "left": left, "seconds": time.monotonic() - started}

    run("ours", (d1, d2), ours, Join([d1, d2]))
    run("theirs", (t1, t2), theirs, TorchJoin([t1, t2]))
    return out


def test_a_pass_out_of_order_once_refuses_nothing_later() -> None:
    world = 2
    results = every_rank_ok(_contexts, world, timeout=30)
    for rank, result in results.items():
        ours, theirs = result["ours"], result["theirs"]
        assert ours["left"] == theirs["left"] == "left", (rank, ours["left"], theirs["left"])
        assert ours["seconds"] < SLOW * 3 + TIMEOUT, (rank, ours["seconds"])
        assert len(ours["steps"]) == len(theirs["steps"]) == BATCHES(world)[rank]
        for i, (a, b) in enumerate(zip(ours["steps"], theirs["steps"], strict=True)):
            for u, v in zip(a, b, strict=True):
                np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6, err_msg=f"{rank} {i}")
