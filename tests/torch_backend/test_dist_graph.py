"""Graphs and dependency plans reused by structure are never stale across passes.

A training loop builds a new torch graph of the same shape on every pass, so the rank's
graph is reused by structure and the engine's dependency plan by graph, roots and sends.
Passes of different shapes (a ring, a star, a tensor sent twice with roots on two ranks,
a graph kept for a second backward) run interleaved on three gloo ranks, and every pass's
gradients must equal the same computation in one process.
"""

from __future__ import annotations

from typing import Any

from ranks import run_ranks

SHAPES = ["ring", "star", "twice", "retain", "star", "ring", "retain", "twice", "ring"]


def _pass(rank: int, world: int, shape: str) -> float:
    """One pass of ``shape``; the largest difference from the one-process gradient."""
    import torch

    from xgrad.torch_backend import dist_autograd as da

    def weights() -> list[torch.Tensor]:
        return [
            torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
            .mul(0.5 + 0.1 * len(shape))
            .requires_grad_()
            for r in range(world)
        ]

    x = torch.linspace(-1, 1, 4, dtype=torch.float64)
    ws = weights()

    def reference() -> torch.Tensor:
        w0, w1, w2 = ws
        h = torch.tanh(w0 * x)
        if shape in ("ring", "retain"):
            loss = (torch.sin(h * w1) * w2 * h).sum()
        elif shape == "star":
            loss = ((h * w1) * h).sum() + ((h * w2) * h).sum()
        else:  # twice: rank 2 sends z twice and has a root of its own
            z = torch.sin(h * w1) * w2
            loss = (z * h).sum() + (z * h * h).sum() + (z * z).sum()
        (grad,) = torch.autograd.grad(loss, ws[rank])
        return grad * (2 if shape == "retain" else 1)

    want = reference()
    ws = weights()
    w = ws[rank]
    with da.context(timeout=20) as cid:
        roots: list[torch.Tensor] = []
        if shape in ("ring", "retain", "twice"):
            if rank == 0:
                h = torch.tanh(w * x)
                da.send(h, 1)
                z = da.recv(2)
                roots = [(z * h).sum()]
                if shape == "twice":
                    roots = [roots[0] + (da.recv(2) * h * h).sum()]
            elif rank == 1:
                da.send(da.recv(0) * w, 2)
            else:
                z = torch.sin(da.recv(1)) * w
                da.send(z, 0)
                if shape == "twice":
                    da.send(z, 0)
                    roots = [(z * z).sum()]
        elif rank == 0:
            h = torch.tanh(w * x)
            da.send(h, 1)
            da.send(h, 2)
            roots = [(da.recv(1) * h).sum() + (da.recv(2) * h).sum()]
        else:
            da.send(da.recv(0) * w, 0)
        if shape == "retain":
            da.backward(cid, roots, retain_graph=True)
        da.backward(cid, roots)
        got = da.get_gradients(cid)[w]
    return float((got - want).abs().max())


def _interleaved(rank: int, world: int) -> list[float]:
    return [_pass(rank, world, shape) for shape in SHAPES]


def test_interleaved_shapes_give_one_process_gradients_every_pass() -> None:
    results, codes = run_ranks(_interleaved, 3, timeout=120)
    assert codes == {0: 0, 1: 0, 2: 0}, (codes, results)
    for rank in range(3):
        status, diffs = results[rank]
        assert status == "ok", (rank, diffs)
        assert len(diffs) == len(SHAPES)
        assert max(diffs) < 1e-12, (rank, dict(zip(SHAPES, diffs, strict=True)))


def _odd_nodes(rank: int, world: int) -> list[float]:
    """Nodes whose results do not line up one to one with the graph's edges: chunk and
    unbind with unused outputs, a Python Function whose backward reads a materialised zero
    gradient for its unused output, one with non-tensor inputs between its tensors, and
    a reentrant checkpoint (its function is its first input)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from xgrad.torch_backend import dist_autograd as da

    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: Any) -> Any:
            return a * 2, a * 3

        @staticmethod
        def backward(ctx: Any, ga: Any, gb: Any) -> Any:
            return ga * 2 + gb * 3 + 1.0

    class Mixed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, k: float, a: Any, s: float, c: Any, b: Any) -> Any:
            ctx.save_for_backward(a, b)
            ctx.k = k
            return a * k * b + c * s

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            a, b = ctx.saved_tensors
            return None, g * ctx.k * b, None, None, g * ctx.k * a * 2

    def sent(w0: Any, v: Any, x: Any, how: str) -> Any:
        h = torch.tanh(w0 @ x)
        if how == "chunk":
            return h.chunk(2)[0] * v
        if how == "unbind":
            return h.unbind(0)[0] * v
        if how == "pair":
            return Pair.apply(h)[0] * v
        if how == "mixed":
            return Mixed.apply(2.0, h, 0.5, x, v)
        return checkpoint(lambda a, b: torch.tanh(a @ x) * b, w0, v, use_reentrant=True)

    diffs = []
    for how in ("chunk", "unbind", "pair", "mixed", "checkpoint"):
        g = torch.Generator().manual_seed(1)
        w0, x = (torch.randn(4, 4, generator=g, dtype=torch.float64) for _ in range(2))
        v, w1 = (torch.randn(4, generator=g, dtype=torch.float64) for _ in range(2))
        ref = [t.clone().requires_grad_() for t in (w0, v, w1)]
        loss = (sent(ref[0], ref[1], x, how) * ref[2]).square().sum()
        loss.backward()  # not autograd.grad: a reentrant checkpoint refuses it
        want = [t.grad for t in (ref[:2] if rank == 0 else ref[2:])]
        mine = [t.clone().requires_grad_() for t in ((w0, v) if rank == 0 else (w1,))]
        with da.context(timeout=20) as cid:
            if rank == 0:
                da.send(sent(*mine, x, how), 1)
                roots = []
            else:
                roots = [(da.recv(0) * mine[0]).square().sum()]
            da.backward(cid, roots)
            got = da.get_gradients(cid)
            for t, w in zip(mine, want, strict=True):
                diffs.append(float((got[t] - w).abs().max()) if t in got else float("inf"))
    return diffs


def test_nodes_whose_results_do_not_match_their_edges_one_to_one_are_exact() -> None:
    results, codes = run_ranks(_odd_nodes, 2, timeout=60)
    assert codes == {0: 0, 1: 0}, (codes, results)
    for rank in range(2):
        status, diffs = results[rank]
        assert status == "ok", (rank, diffs)
        assert max(diffs) < 1e-12, (rank, diffs)
