"""The skip round's keys outlive a step that failed on one rank before it needed the others.

Two gloo ranks, ``find_unused_parameters``, a model of two branches. Every rank runs a
validation forward pass through branch ``a`` with gradients on and no backward; the next
pass is a ``no_sync`` one through branch ``b``, which the reducer, still prepared for the
validation pass, reduces (as PyTorch's does), and whose hook of a parameter the validation
pass left unused raises "Expected to mark a variable ready only once" (PyTorch's error
there, too). At that pass's forward each rank had said in the skip round that it skipped
the validation pass's backward and waited for the other's notice. Rank 0, the lowest,
came second, raised in its hook at once and at its next forward pass deleted the round's
keys, while rank 1, polling slowly (a busy thread holds the GIL here), still waited for
them: it waited out the DDP's timeout, and every step after failed or paired with the
wrong one. The keys now stay until a step ends well: both ranks raise rank 0's error at
that pass, the synchronised pass after it recovers on both (PyTorch's DDP raises its
"prior iteration" error there and at every later step), and the step after gives both
ranks' mean gradient, each pass within the timeout.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import torch
from branches import Branches
from ranks import run_ranks

FAST = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
TIMEOUT = 5.0


def _batch(rank: int, i: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * rank + i))


def _steps(rank: int, world: int) -> dict[str, Any]:
    import warnings

    from xgrad.torch_backend import DistributedDataParallel

    os.environ.update(FAST)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = Branches()
    ddp = DistributedDataParallel(model, find_unused_parameters=True, timeout=TIMEOUT)
    log: dict[str, Any] = {}

    def record(name: str, branch: str, i: int, sync: bool) -> None:
        start = time.monotonic()
        try:
            if sync:
                ddp(_batch(rank, i), branch).pow(2).mean().backward()
            else:
                with ddp.no_sync():
                    ddp(_batch(rank, i), branch).pow(2).mean().backward()
            log[name] = "ok"
        except Exception as exc:
            log[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        log[name + " s"] = time.monotonic() - start

    record("step", "a", 0, True)
    model.zero_grad()
    ddp(_batch(rank, 1), "a").pow(2).mean()  # validation: no backward, on every rank
    if rank == 1:
        # Rank 1 reaches the round first (rank 0 sleeps) and, while rank 0 posts its
        # notice, raises and begins its next pass, polls for the keys 0.1 s apart: a busy
        # thread holds the GIL meanwhile (for 1.5 s).
        switch = sys.getswitchinterval()
        sys.setswitchinterval(0.1)
        end = time.monotonic() + 1.5

        def spin() -> None:
            while time.monotonic() < end:
                pass

        spinner = threading.Thread(target=spin)
        spinner.start()
    else:
        time.sleep(1.0)
    record("no_sync", "b", 2, False)
    if rank == 1:
        spinner.join()
        sys.setswitchinterval(switch)
    record("synchronised", "a", 3, True)
    model.zero_grad()
    record("no_sync after", "a", 4, False)
    record("step after", "a", 5, True)
    log["grad"] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return log


def _mean_grads() -> list[torch.Tensor]:
    """The last step's gradients on one process: both ranks' two passes, averaged."""
    sums: list[torch.Tensor] = []
    for rank in (0, 1):
        torch.manual_seed(0)
        model = Branches()
        for i in (4, 5):
            model(_batch(rank, i), "a").pow(2).mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        sums = grads if not sums else [s + g for s, g in zip(sums, grads, strict=True)]
    return [s / 2 for s in sums]


def test_a_step_failing_after_the_skip_round_keeps_the_ranks_in_step() -> None:
    results, codes = run_ranks(_steps, 2, timeout=120)
    assert codes == {0: 0, 1: 0}, results
    logs = [results[r][1] for r in (0, 1)]
    for log in logs:
        assert log["step"] == "ok", log
        assert log["no_sync"].startswith(
            "RankError: rank 0 in gradient hook of b.bias: RuntimeError: Expected to mark "
            "a variable ready only once"
        ), log
        assert log["synchronised"] == log["no_sync after"] == log["step after"] == "ok", log
        assert all(log[k] < TIMEOUT - 1 for k in log if k.endswith(" s")), log
        for got, want in zip(log["grad"], _mean_grads(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
