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
