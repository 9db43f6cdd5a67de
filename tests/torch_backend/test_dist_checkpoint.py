"""Activation checkpointing inside a rank's part of a distributed backward pass.

``torch.utils.checkpoint`` in both modes on both ways to run a rank's graph: the node
engine calls the checkpoint's node (which recomputes), and the waves engine hands a pass
through a reentrant checkpoint, which torch runs only under ``backward``, to the node
engine. Gradients equal one process's.
"""

from __future__ import annotations

import torch
from ranks import run_ranks
from torch.utils.checkpoint import checkpoint

from xgrad.torch_backend import dist_autograd as da


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * w) * w


def _leaves() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, generator=g, dtype=torch.float64).requires_grad_()
    return w, torch.randn(4, generator=g, dtype=torch.float64).requires_grad_()


def _checkpointed(rank: int, world: int) -> dict[str, float]:
    """Rank 0 sends a checkpointed block's output; rank 1 squares it."""
    out = {}
    for execute in ("nodes", "waves"):
        for reentrant in (False, True):
            da.EXECUTE = execute
            w, x = _leaves()
            with da.context(timeout=20) as cid:
                if rank == 0:
                    da.send(checkpoint(_block, x, w, use_reentrant=reentrant), 1)
                    da.backward(cid, [])
                    got = da.get_gradients(cid)
                    y = _block(x, w)
                    want = torch.autograd.grad((y * y * 3).sum(), [w, x])
                    pairs = zip((w, x), want, strict=True)
                    worst = max(float((got[t] - g).abs().max()) for t, g in pairs)
                    out[f"{execute}/{reentrant}"] = worst
                else:
                    t = da.recv(0)
                    da.backward(cid, [(t * t * 3).sum()])
    return out


def test_checkpointed_blocks_give_one_process_s_gradients_on_both_engines() -> None:
    results, codes = run_ranks(_checkpointed, 2, timeout=90)
    assert all(code == 0 for code in codes.values()), (codes, results)
    status, out = results[0]
    assert status == "ok", out
    assert sorted(out) == ["nodes/False", "nodes/True", "waves/False", "waves/True"]
    for case, worst in out.items():
        assert worst < 1e-12, (case, worst)


def _counted(rank: int, world: int) -> dict[str, object]:
    """Rank 1 runs a non-reentrant checkpoint of ten nodes and a BatchNorm around a
    received tensor; counts its runs and reads the BatchNorm's statistics."""
    out: dict[str, object] = {}
    for execute in ("nodes", "waves"):
        da.EXECUTE = execute
        torch.manual_seed(0)
        norm = torch.nn.BatchNorm1d(4).double()
        lin = torch.nn.Linear(4, 4).double()
        runs = [0]

        def block(
            h: torch.Tensor,
            norm: torch.nn.Module = norm,
            lin: torch.nn.Module = lin,
            runs: list[int] = runs,
        ) -> torch.Tensor:
            runs[0] += 1
            h = norm(lin(h))  # a product of a received tensor: the node engine splits it
            for _ in range(10):
                h = (h * h).sin()
            return h

        x = torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(8, 4).requires_grad_()
        with da.context(timeout=20) as cid:
            if rank == 0:
                da.send(x * 1, 1)
                da.backward(cid, [])
            else:
                z = checkpoint(block, da.recv(0), use_reentrant=False)
                da.backward(cid, [z.sum()])
                out[execute] = (runs[0], int(norm.num_batches_tracked), norm.running_mean.tolist())
    return out


def test_a_non_reentrant_checkpoint_is_recomputed_once_per_pass() -> None:
    """The node engine calls torch's nodes outside torch's engine, where each saved
    tensor's unpack was a graph task of its own: the region ran once per saved tensor
    (12 times here), and BatchNorm's running statistics moved as often. The pass is one
    GraphExecGroup now: one forward, one recomputation, as in one process. (torch's own
    engine, one call per wave, recomputes once more where a wave resumes: at most 3.) The
    region's matrix product takes a received tensor, which the node engine splits
    (dist_split): reading its operands as the graph was built recomputed the region too."""
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(4).double()
    lin = torch.nn.Linear(4, 4).double()

    def block(h: torch.Tensor) -> torch.Tensor:
        h = norm(lin(h))
        for _ in range(10):
            h = (h * h).sin()
        return h

    x = torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(8, 4).requires_grad_()
    checkpoint(block, x * 1, use_reentrant=False).sum().backward()
    results, codes = run_ranks(_counted, 2, timeout=90)
    assert all(code == 0 for code in codes.values()), (codes, results)
    status, out = results[1]
    assert status == "ok", out
    runs, tracked, mean = out["nodes"]
    assert (runs, tracked) == (2, int(norm.num_batches_tracked))
    torch.testing.assert_close(
        torch.tensor(mean, dtype=torch.float64), norm.running_mean, rtol=1e-13, atol=1e-16
    )
    assert out["waves"][0] <= 3


def _sends_inside(rank: int, world: int) -> str:
    with da.context(timeout=10) as cid:
        if rank == 0:
            w = torch.ones(3, dtype=torch.float64, requires_grad=True)

            def f(x: torch.Tensor) -> torch.Tensor:
                y = x.sin()
                da.send(y, 1)
                return y * y

            z = checkpoint(f, w * 1, use_reentrant=False)
            try:
                da.backward(cid, [z.sum()])
            except da.DistBackwardError as exc:
                return str(exc)
        else:
            try:
                # (under load rank 0's failure can be posted before this receive is
                # waited for: the receive raises it then, the same error)
                r = da.recv(0)
                da.backward(cid, [r.sum()])
            except da.DistBackwardError as exc:
                return str(exc)
    return "ran"


def test_a_send_inside_a_checkpointed_function_is_named_when_it_runs_again() -> None:
    """Its recomputation in backward sent the tensor again, to a peer that took no more;
    the context's exit then said only "sent rank 1 2 tensors, rank 1 received 1"."""
    results, _ = run_ranks(_sends_inside, 2, timeout=90)
    for rank in (0, 1):
        status, message = results[rank]
        assert status == "ok", message
        assert "Error on rank 0" in message and "send during the backward pass" in message
        assert "checkpointed" in message
