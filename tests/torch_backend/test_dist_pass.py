"""A received tensor's tensor hooks shape the gradient that goes back to its sender.

A received tensor is a leaf of the receiving rank's graph; in one process it would be an
intermediate whose hooks change what flows further back. So the gradient returned to the
sender is what the hooks return, run once on the summed gradient, on two gloo ranks
against the same computation in one process; a hook that raises fails the pass on every
rank, named, and the next context works.
"""

from __future__ import annotations

from typing import Any

from ranks import run_ranks


def _hooked(rank: int, world: int) -> list[Any]:
    import torch

    from xgrad.torch_backend import dist_autograd as da

    g = torch.Generator().manual_seed(2)
    w0, x = (torch.randn(4, 4, generator=g, dtype=torch.float64) for _ in range(2))
    w1 = torch.randn(4, generator=g, dtype=torch.float64)
    ref = [w0.clone().requires_grad_(), w1.clone().requires_grad_()]
    h = torch.tanh(ref[0] @ x)
    h.register_hook(lambda grad: grad * 5)
    loss = (h * ref[1]).square().sum() + (h * h).sum()
    want = torch.autograd.grad(loss, ref[rank])[0]
    w = (w0 if rank == 0 else w1).clone().requires_grad_()
    seen = []
    with da.context(timeout=20) as cid:
        if rank == 0:
            da.send(torch.tanh(w @ x), 1)
            roots = []
        else:
            r = da.recv(0)
            r.register_hook(lambda grad: seen.append(1) or grad * 5)
            roots = [(r * w).square().sum() + (r * r).sum()]
        da.backward(cid, roots)
        diff = float((da.get_gradients(cid)[w] - want).abs().max())
    # A hook that raises fails the pass on every rank, named; the next context works.
    try:
        with da.context(timeout=20) as cid:
            if rank == 0:
                da.send(w * 2, 1)
                roots = []
            else:
                r = da.recv(0)
                r.register_hook(lambda grad: 1 / 0)
                roots = [(r * r).sum()]
            da.backward(cid, roots)
        failure = "no error"
    except da.DistBackwardError as exc:
        failure = str(exc)
    with da.context(timeout=20) as cid:
        if rank == 0:
            da.send(w * 2, 1)
            roots = []
        else:
            roots = [(da.recv(0) * w).sum()]
        da.backward(cid, roots)
        after = len(da.get_gradients(cid))
    return [diff, float(len(seen)), failure, after]


def test_a_received_tensors_hook_changes_what_its_sender_gets() -> None:
    results, codes = run_ranks(_hooked, 2, timeout=60)
    assert codes == {0: 0, 1: 0}, (codes, results)
    assert results[0][0] == "ok" and results[0][1][0] < 1e-12, results
    assert results[1][0] == "ok" and results[1][1][0] < 1e-12, results
    assert results[1][1][1] == 1, results  # the hook ran once, on the summed gradient
    for rank in range(2):
        failure, after = results[rank][1][2:]
        assert "Error on rank 1 in recv from rank 0: ZeroDivisionError" in failure, failure
        assert after == 1, (rank, after)
