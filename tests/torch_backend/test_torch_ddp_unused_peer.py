"""One rank's "received no gradient" error reaches the others at once; the next step works.

Two gloo ranks, no ``find_unused_parameters``; in one step rank 1 leaves a layer unused
while rank 0 uses it. Rank 1 raises DDP's error at the end of its backward (PyTorch's
text), and stays alive. Rank 0 waited for the buckets rank 1 would never launch until
the DDP's whole timeout (as PyTorch's DDP does), then named itself; the error is now
posted, so rank 0 raises it within a poll, naming rank 1, and the steps after give both
ranks the gradients of one process.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from ranks import run_ranks
from test_torch_ddp_nosync_unused import Branchy

TIMEOUT = 20.0


def _steps(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(Branchy().double(), timeout=TIMEOUT, bucket_cap_mb=1e-4)
    x = torch.ones(2, 4, dtype=torch.float64) * (rank + 1)
    out: dict[str, Any] = {"errors": [], "grads": []}
    for step in range(3):
        ddp.zero_grad()
        start = time.monotonic()
        try:
            ddp(x, not (step == 1 and rank == 1)).sum().backward()
        except RuntimeError as exc:
            out["errors"].append((step, str(exc), time.monotonic() - start))
            continue
        out["grads"].append([p.grad.tolist() for p in ddp.module.parameters()])
    return out


def test_a_peers_unused_parameter_error_is_raised_at_once_and_the_next_step_works() -> None:
    results, codes = run_ranks(_steps, 2, timeout=120)
    assert codes == {0: 0, 1: 0}, (codes, results)
    torch.manual_seed(0)
    model = Branchy().double()
    for r in range(2):  # one process: the mean of the two ranks' gradients
        (model(torch.ones(2, 4, dtype=torch.float64) * (r + 1), True).sum() / 2).backward()
    want = [p.grad.tolist() for p in model.parameters()]
    for rank in (0, 1):
        status, out = results[rank]
        assert status == "ok", out
        [(step, text, seconds)] = out["errors"]
        assert step == 1, out["errors"]
        assert "Parameters which did not receive grad for rank 1: c.weight, c.bias" in text, text
        if rank == 0:
            assert text.startswith("rank 1 in backward: RuntimeError: Some parameters"), text
            assert seconds < 5.0, seconds  # not the 20 s timeout
        assert out["grads"][0] == out["grads"][1], "the step after differs from the one before"
        for got, expected in zip(out["grads"][1], want, strict=True):
            torch.testing.assert_close(
                torch.tensor(got, dtype=torch.float64),
                torch.tensor(expected, dtype=torch.float64),
                rtol=1e-13,
                atol=1e-13,
            )
