"""What torch's engine does after a pass that xgrad's must do too, and what may travel.

- A pass without ``retain_graph`` frees what its nodes saved for backward, as torch's
  engine does: the node engine calls torch's nodes itself, and their activations stayed
  as long as anything held the graph (a loop that kept its losses kept every step's).
- A rank's send to itself under ``torch.inference_mode`` is detached, as a send to a peer
  there is (grad mode is off: ``test_dist_grad_mode``), and made outside inference mode,
  as a peer's receive is: the copy kept was an inference tensor, which autograd refuses.
- Dense tensors of the dtypes gloo does not move (unsigned, float8, complex32) travel as
  their bytes, as PyTorch's RPC sends them (they were refused).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ranks import run_ranks

from xgrad.torch_backend import dist_autograd as da


def _freed(rank: int, world: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for execute in ("nodes", "waves"):
        da.EXECUTE = execute
        for retain in (False, True):
            w = torch.ones(4, dtype=torch.float64, requires_grad=True)
            node = None
            with da.context(timeout=20) as cid:
                if rank == 0:
                    da.send((w * 2).sin(), 1)
                    da.backward(cid, [], retain_graph=retain)
                else:
                    z = (da.recv(0) * w).exp()
                    da.backward(cid, [z.sum()], retain_graph=retain)
                    node = z.grad_fn
            if node is not None:  # freed at the context's exit, off the pass's path
                try:
                    _ = node._saved_result
                    out[f"{execute}/{retain}"] = "kept"
                except RuntimeError as exc:
                    out[f"{execute}/{retain}"] = str(exc)
    return out


def test_a_pass_without_retain_graph_frees_what_its_nodes_saved() -> None:
    results, codes = run_ranks(_freed, 2, timeout=90)
    assert all(code == 0 for code in codes.values()), (codes, results)
    status, out = results[1]
    assert status == "ok", out
    for execute in ("nodes", "waves"):
        assert out[f"{execute}/True"] == "kept"
        assert "backward through the graph a second time" in out[f"{execute}/False"], out


def _self_inference(rank: int, world: int) -> list[Any]:
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    v = torch.full((3,), 2.0, dtype=torch.float64, requires_grad=True)
    with da.context(timeout=20) as cid:
        if rank == 0:
            with torch.inference_mode():
                da.send(w, 0)  # to itself
                da.send(w, 1)
            a = da.recv(0)
            da.backward(cid, [(a * v).sum()])  # a saved for backward: not an inference tensor
            grads = da.get_gradients(cid)
            return [a.requires_grad, a.is_inference(), w in grads, grads[v].tolist()]
        b = da.recv(0)
        da.backward(cid, [(b * v).sum()])
        return [b.requires_grad, b.is_inference()]


def test_a_send_to_itself_under_inference_mode_is_detached_as_to_a_peer() -> None:
    results, codes = run_ranks(_self_inference, 2, timeout=90)
    assert all(code == 0 for code in codes.values()), (codes, results)
    assert results[0] == ("ok", [False, False, False, [1.0, 1.0, 1.0]])
    assert results[1] == ("ok", [False, False])


_BYTE_DTYPES = ["uint16", "uint32", "uint64", "complex32", "float8_e4m3fn", "float8_e5m2"]


def _sample(name: str) -> torch.Tensor:
    base = torch.arange(-3, 5, dtype=torch.float32) * 0.75
    if name.startswith("uint"):
        return torch.arange(0, 8, dtype=torch.int64).mul(1000003).to(getattr(torch, name))
    if name == "complex32":
        return torch.complex(base, base * 2).to(torch.complex32)
    return base.to(getattr(torch, name))


def _dtypes(rank: int, world: int) -> dict[str, bool]:
    out = {}
    for name in _BYTE_DTYPES:
        t = _sample(name).reshape(2, 4)[:, ::2]  # strided too
        with da.context(timeout=20) as cid:
            if rank == 0:
                da.send(t, 1)
            else:
                r = da.recv(0)
                same = r.dtype == t.dtype and r.shape == t.shape
                out[name] = same and torch.equal(
                    r.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)
                )
            da.backward(cid, [])
    return out


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="a torch without float8")
def test_dtypes_gloo_does_not_move_travel_as_their_bytes() -> None:
    results, codes = run_ranks(_dtypes, 2, timeout=90)
    assert all(code == 0 for code in codes.values()), (codes, results)
    assert results[1] == ("ok", dict.fromkeys(_BYTE_DTYPES, True)), results[1]


def _unused_send(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for execute in ("nodes", "waves"):
        da.EXECUTE = execute
        w = torch.ones(3, dtype=torch.float64, requires_grad=True)
        v = torch.ones(3, dtype=torch.float64, requires_grad=True)
        with da.context(timeout=20) as cid:
            if rank == 0:
                h = (w * 2).sin()
                da.send(h.exp(), 1)  # rank 1 leaves it out of its loss: no gradient comes
                local = (h * h).sum()
                da.backward(cid, [])
                local.backward()  # through h, whose part of the graph the pass never ran
                out[execute] = w.grad.tolist()  # type: ignore[union-attr]
            else:
                da.recv(0)
                da.backward(cid, [(v * 2).sum()])
    return out


def test_what_the_pass_did_not_run_keeps_its_saved_tensors() -> None:
    """A send whose peer sent no gradient back leaves its part of the graph unrun (as in
    torch's engine); its saved tensors were freed all the same, and a local backward
    through a tensor it shares then raised "backward through the graph a second time"."""
    results, codes = run_ranks(_unused_send, 2, timeout=90)
    assert all(code == 0 for code in codes.values()), (codes, results)
    status, out = results[0]
    assert status == "ok", out
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    h = (w * 2).sin()
    (h * h).sum().backward()
    assert w.grad is not None
    assert out == {"nodes": w.grad.tolist(), "waves": w.grad.tolist()}
