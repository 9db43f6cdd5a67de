"""A tensor sent after its receiver already failed: the sender's pass raises at once.

A rank that fails outside a pass (an error in its forward code, or another rank's seen
in a ``recv``) answers every tensor its peers sent it with a poison gradient, so that no
peer's backward pass waits for a gradient it will never send. It finds those tensors by
their headers in the store, and a peer that sends after that read is not answered: its
backward pass used to wait for the gradient on its own thread, which only a message or
the context's timeout ends (here 20 s, and the next context then failed too, with a
timeout naming rank 0). The pass now reads the failure channel once before its first
wait, after every send of the context: either the failure was posted before that read,
which sees it, or after, and then the failing rank's read of the headers came later
still and found the tensor. Three real gloo ranks; rank 2 sends late on purpose.
"""

from __future__ import annotations

import time
from typing import Any

from ranks import run_ranks

TIMEOUT = 20.0


def _late_sender(rank: int, world: int) -> dict[str, Any]:
    import torch

    from xgrad.torch_backend import dist_autograd as da

    w = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    w.requires_grad_()

    def step(fail: bool) -> torch.Tensor:
        with da.context(timeout=TIMEOUT) as cid:
            if rank == 0:
                da.send(w * 2, 1)
                da.send(w * 3, 2)
                roots = [da.recv(2).sum()]
            else:
                t = da.recv(0)
                if fail and rank == 1:
                    raise RuntimeError("rank 1 failed in its forward code")
                if fail and rank == 2:
                    time.sleep(1.0)  # rank 0 has answered what it was sent by then
                out = t @ w
                if rank == 2:
                    da.send(out, 0)
                    roots = []
                else:
                    roots = [out.sum()]
            da.backward(cid, roots)
            return da.get_gradients(cid)[w]

    result: dict[str, Any] = {"clean": step(fail=False)}
    start = time.monotonic()
    try:
        step(fail=True)
        result["error"] = None
    except Exception as exc:  # every rank raises rank 1's failure
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["seconds"] = time.monotonic() - start
    result["next_equal"] = [bool(torch.equal(step(fail=False), result["clean"])) for _ in range(2)]
    del result["clean"]
    return result


def test_a_tensor_sent_after_the_receiver_failed_does_not_hold_the_pass() -> None:
    results, codes = run_ranks(_late_sender, 3, timeout=120)
    assert codes == {0: 0, 1: 0, 2: 0}, (codes, results)
    for rank in range(3):
        status, got = results[rank]
        assert status == "ok", (rank, got)
        if rank == 1:  # the origin raises its own error
            assert got["error"] == "RuntimeError: rank 1 failed in its forward code", got
        else:
            assert got["error"] is not None and got["error"].startswith("DistBackwardError"), got
            assert "rank 1 in forward" in got["error"], (rank, got["error"])
        # Rank 2 sleeps 1 s on purpose; far below the context's 20 s timeout.
        assert got["seconds"] < 1.0 + 3.0, (rank, got)
        assert got["next_equal"] == [True, True], (rank, got)
