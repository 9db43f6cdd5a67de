"""One rank's "received no gradient" failure reaches the others at once; the next step works.

Two gloo ranks, no ``find_unused_parameters``; in one step rank 1 leaves a layer unused
while rank 0 uses it. PyTorch's DDP ends rank 1's backward pass without a word and raises
"Expected to have finished reduction in the prior iteration" at its next forward pass;
rank 0 waits for the buckets rank 1 never launches until the whole timeout. xgrad's rank 1
ends its pass as PyTorch's does and posts why: rank 0 stops waiting within a poll and ends
its pass too, and both raise at their next forward pass (rank 1 PyTorch's text, rank 0 the
posted one, naming rank 1), so their loops stay in step; the step after gives both ranks
the gradients of one process.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from ranks import run_ranks
from test_torch_ddp_nosync_unused import Branchy

TIMEOUT = 20.0


def _steps(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(Branchy().double(), timeout=TIMEOUT, bucket_cap_mb=1e-4)
    x = torch.ones(2, 4, dtype=torch.float64) * (rank + 1)
    out: dict[str, Any] = {"errors": [], "grads": {}, "seconds": {}}
    for step in range(4):
        ddp.zero_grad()
        try:
            y = ddp(x, not (step == 1 and rank == 1))
        except RuntimeError as exc:
            out["errors"].append((step, str(exc)))
            continue
        start = time.monotonic()
        y.sum().backward()
        out["seconds"][step] = time.monotonic() - start
        out["grads"][step] = [
            None if p.grad is None else p.grad.tolist() for p in ddp.module.parameters()
        ]
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
        [(step, text)] = out["errors"]
        assert step == 2, out["errors"]  # both at the forward pass after the failed one
        if rank == 0:
            assert text.startswith(
                "rank 1 in backward (parameters without a gradient): RuntimeError: Some "
                "parameters received no gradient"
            ), text
            assert "Parameters which did not receive grad for rank 1: c.weight, c.bias" in text
            assert out["seconds"][1] < 5.0, out["seconds"]  # not the 20 s timeout
        else:
            assert text.startswith("Expected to have finished reduction in the prior"), text
            assert "Parameter indices which did not receive grad for rank 1: 2 3" in text, text
        assert out["grads"][3] == out["grads"][0], "the step after differs from the one before"
        for got, expected in zip(out["grads"][3], want, strict=True):
            torch.testing.assert_close(
                torch.tensor(got, dtype=torch.float64),
                torch.tensor(expected, dtype=torch.float64),
                rtol=1e-13,
                atol=1e-13,
            )


def _trained(rank: int, world: int, hook: str) -> dict[str, Any]:
    """The same failure in a loop with an optimizer step, with a comm hook whose futures
    chain ``.then()`` (the peers see the failure in a gradient hook, waiting for a bucket)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(Branchy().double(), timeout=TIMEOUT, bucket_cap_mb=1e-4)
    if hook == "then":
        ddp.register_comm_hook(
            None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)
        )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    x = torch.ones(2, 4, dtype=torch.float64) * (rank + 1)
    out: dict[str, Any] = {"errors": [], "none_after": []}
    for step in range(5):
        opt.zero_grad()
        try:
            y = ddp(x, not (step == 1 and rank == 1))
        except RuntimeError as exc:
            out["errors"].append((step, "forward", str(exc)[:80]))
            continue
        try:
            y.sum().backward()
        except RuntimeError as exc:
            out["errors"].append((step, "backward", str(exc)[:80]))
            continue
        out["none_after"].append(all(p.grad is None for p in ddp.parameters()))
        opt.step()
    out["params"] = torch.cat([p.detach().flatten() for p in ddp.parameters()]).tolist()
    return out


@pytest.mark.parametrize("hook", ["plain", "then"])
def test_replicas_stay_equal_and_in_step_after_the_error(hook: str) -> None:
    # With a hook whose futures chain .then(), the peer raised in that backward pass while
    # the culprit raised at its next forward: each rank's next step paired with the other's
    # step after it (wrong gradients, no error), then a wait to the timeout. And the pass's
    # partly reduced gradients, kept, went into an optimizer step before the error came:
    # replicas that differed for good, every later step without an error.
    results, codes = run_ranks(_trained, 2, args=(hook,), timeout=120)
    assert codes == {0: 0, 1: 0}, (codes, results)
    outs = [results[r][1] for r in (0, 1)]
    for rank, out in enumerate(outs):
        assert results[rank][0] == "ok", out
        assert [(s, where) for s, where, _ in out["errors"]] == [(2, "forward")], out["errors"]
        assert out["none_after"] == [False, True, False, False], out  # step 1's: dropped
    assert outs[0]["params"] == outs[1]["params"]


def _joined(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's last step (of 2) leaves c unused, then it joins; rank 0 trains 4 steps."""
    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(Branchy().double(), timeout=TIMEOUT, bucket_cap_mb=1e-4)
    x = torch.ones(2, 4, dtype=torch.float64) * (rank + 1)
    out: dict[str, Any] = {"steps": [], "join": "no error"}
    start = time.monotonic()
    try:
        with ddp.join():
            for step in range(4 if rank == 0 else 2):
                ddp.zero_grad()
                try:
                    ddp(x, not (step == 1 and rank == 1)).sum().backward()
                    out["steps"].append("ok")
                except RuntimeError as exc:
                    out["steps"].append(str(exc)[:60])
    except RuntimeError as exc:
        out["join"] = str(exc)[:60]
    out["seconds"] = time.monotonic() - start
    return out


def test_a_rank_that_joins_right_after_the_failed_step_leaves_no_one_waiting() -> None:
    # Rank 0's forward pass that raised dropped the failed step with a fresh group, which
    # rank 1, counting the ranks still training in its join, never made: both waited out
    # the timeout, then failed (this was so before the error moved to the next forward).
    results, codes = run_ranks(_joined, 2, timeout=120)
    assert codes == {0: 0, 1: 0}, (codes, results)
    first, second = results[0][1], results[1][1]
    assert first["steps"][:2] == ["ok", "ok"] and first["steps"][3] == "ok", first
    assert first["steps"][2].startswith("rank 1 in backward (parameters without"), first
    assert first["join"] == "no error", first
    assert second["steps"] == ["ok", "ok"], second
    assert second["join"].startswith("Expected to have finished reduction in the prior"), second
    assert first["seconds"] < TIMEOUT and second["seconds"] < TIMEOUT, (first, second)
