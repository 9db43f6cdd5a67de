"""Distributed autograd with torch's graph features around sends and recvs, on gloo ranks,
against one process computing the same graph.

* ``register_multi_grad_hook(..., mode="any")`` over tensors that cross a send ran its
  hook once for every tensor a gradient reached (twice here), where torch runs it once per
  backward call: torch keys "ran already" by the graph task, and xgrad's engine runs each
  node's hooks in a graph task of their own. Now once per distributed pass.
* A leaf as a root (``backward(cid, [leaf])``, a sent leaf too) gets gradient 1 added, as
  PyTorch's distributed ``backward`` gives it; ``saved_tensors_hooks`` around sends and
  recvs pack and unpack what the ops save, the gradients unchanged (both were right before
  and are kept so here).
"""

from __future__ import annotations

from typing import Any

import torch
from ranks import run_ranks

TIMEOUT = 20.0


def _w(seed: int, n: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64).requires_grad_()


def _cases(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import dist_autograd as da

    out: dict[str, Any] = {}
    w, v = _w(1), _w(2)
    fired: list[torch.Tensor] = []
    with da.context(timeout=TIMEOUT) as cid:  # an "any" hook on each side, two passes
        if rank == 0:
            a, b = w * 2, w * 3
            torch.autograd.graph.register_multi_grad_hook((a, b), fired.append, mode="any")
            da.send(a, 1)
            da.send(b, 1)
            for _ in range(2):
                da.backward(cid, [], retain_graph=True)
            out["any"] = (len(fired), da.get_gradients(cid)[w])
        else:
            a, b = da.recv(0), da.recv(0)
            torch.autograd.graph.register_multi_grad_hook((a, b), fired.append, mode="any")
            loss = (a * v + b * v * v).sum()
            for _ in range(2):
                da.backward(cid, [loss], retain_graph=True)
            out["any"] = (len(fired), da.get_gradients(cid)[v])
    s = _w(3, 1).sum().detach().requires_grad_()  # a scalar leaf
    with da.context(timeout=TIMEOUT) as cid:  # leaves as roots, one of them sent
        if rank == 0:
            da.send(s, 1)
            da.backward(cid, [s])
            out["leaf"] = da.get_gradients(cid)[s]
        else:
            t = _w(4, 1).sum().detach().requires_grad_()
            da.backward(cid, [t, (da.recv(0) * v).sum()])
            g = da.get_gradients(cid)
            out["leaf"] = (g[t], g[v])
    calls: list[str] = []

    def pack(x: torch.Tensor) -> tuple[str, torch.Tensor]:
        calls.append("pack")
        return ("packed", x.clone())

    def unpack(p: tuple[str, torch.Tensor]) -> torch.Tensor:
        calls.append("unpack")
        return p[1]

    with da.context(timeout=TIMEOUT) as cid:  # saved_tensors_hooks around send and recv
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            if rank == 0:
                da.send(w * w, 1)
            else:
                r = da.recv(0)
                loss = (r * r * v).sum()
        da.backward(cid, [] if rank == 0 else [loss])
        out["saved"] = (da.get_gradients(cid)[w if rank == 0 else v], calls.count("pack") > 0)
    return out


def test_any_hooks_leaf_roots_and_saved_tensor_hooks_give_one_process_gradients() -> None:
    results, codes = run_ranks(_cases, 2, timeout=120)
    assert codes == {0: 0, 1: 0}, (codes, results)
    out0, out1 = results[0][1], results[1][1]
    assert results[0][0] == results[1][0] == "ok", results
    w, v = _w(1), _w(2)
    # One process, the same graph: a hook of mode "any" runs once per backward call.
    fired: list[torch.Tensor] = []
    a, b = w * 2, w * 3
    torch.autograd.graph.register_multi_grad_hook((a, b), fired.append, mode="any")
    loss = (a * v + b * v * v).sum()
    for _ in range(2):
        gw, gv = torch.autograd.grad(loss, [w, v], retain_graph=True)
    assert len(fired) == 2, fired
    assert out0["any"][0] == out1["any"][0] == 2, (out0["any"], out1["any"])
    torch.testing.assert_close(out0["any"][1], 2 * gw)
    torch.testing.assert_close(out1["any"][1], 2 * gv)
    s, t = _w(3, 1).sum(), _w(4, 1).sum()
    torch.testing.assert_close(out0["leaf"], v.detach().sum() + 1)
    torch.testing.assert_close(out1["leaf"][0], torch.ones_like(t))
    torch.testing.assert_close(out1["leaf"][1], s.detach().expand(3))
    r = w * w
    gw, gv = torch.autograd.grad((r * r * v).sum(), [w, v])
    assert out0["saved"][1] and out1["saved"][1], (out0["saved"], out1["saved"])
    torch.testing.assert_close(out0["saved"][0], gw)
    torch.testing.assert_close(out1["saved"][0], gv)
