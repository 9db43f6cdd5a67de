"""A tensor sent with grad mode off, on two gloo ranks, against one process.

PyTorch's RPC attaches no autograd information to a call made with grad mode off: its
sender gets no gradient. xgrad sent such a tensor as requiring grad and gave the sender a
gradient all the same (a leaf sent under ``torch.no_grad()`` came out of the pass with
one). Now it is sent detached, to a peer and to the sender itself: the received tensor
does not require grad and is, to the receiver's backward, a plain constant (a gradient
of a parameter it multiplies as with a constant; a root made from it alone refused as a
constant root is), and the sender gets nothing for it. Both engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from ranks import run_ranks

TIMEOUT = 20.0
MODES: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


def _w(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, generator=g, dtype=torch.float64).requires_grad_()


def _list(t: torch.Tensor | None) -> list[float] | None:
    return None if t is None else t.tolist()


def _node(t: torch.Tensor) -> str | None:
    return None if t.grad_fn is None else type(t.grad_fn).__name__


def _cases(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import dist_autograd as da

    out: dict[str, Any] = {}
    for execute in ("nodes", "waves"):
        da.EXECUTE = execute
        for mode, off in MODES.items():
            case = f"{execute}/{mode}"
            w, q = _w(1), _w(2)
            with da.context(timeout=TIMEOUT) as cid:  # a leaf sent to a peer, grad mode off
                if rank == 0:
                    with off():
                        da.send(w, 1)
                    da.send(w * 3, 1)  # and a tensor with grad mode on: its gradient comes
                    da.backward(cid, [], accumulate_grad=True)
                    grads = da.get_gradients(cid).items()
                    out[f"peer {case}"] = ([(k is w, g.tolist()) for k, g in grads], _list(w.grad))
                else:
                    r, s = da.recv(0), da.recv(0)
                    out[f"received {case}"] = (r.requires_grad, _node(r), s.requires_grad)
                    da.backward(cid, [(r * s * q).sum() + (r * q).sum()])
                    out[f"peer {case}"] = da.get_gradients(cid)[q].tolist()
            w, v = _w(1), _w(3)
            with da.context(timeout=TIMEOUT) as cid:  # a leaf sent to this rank itself
                if rank == 0:
                    with off():
                        da.send(w, 0)
                    a = da.recv(0)
                    out[f"self received {case}"] = (a.requires_grad, _node(a))
                    da.backward(cid, [(a * v).sum()])
                    out[f"self {case}"] = [
                        (k is v, g.tolist()) for k, g in da.get_gradients(cid).items()
                    ]
                else:
                    da.backward(cid, [])
    try:  # the receiver's only root made from such a tensor: refused as a constant is
        with da.context(timeout=TIMEOUT) as cid:
            if rank == 0:
                with torch.no_grad():
                    da.send(_w(1), 1)
                da.backward(cid, [])
            else:
                da.backward(cid, [(da.recv(0) * 2).sum()])
    except da.DistBackwardError as exc:
        out["constant root"] = str(exc)
    with da.context(timeout=TIMEOUT) as cid:  # and the next context works
        if rank == 0:
            w = _w(1)
            da.send(w * 2, 1)
            da.backward(cid, [])
            out["after"] = da.get_gradients(cid)[w].tolist()
        else:
            da.backward(cid, [(da.recv(0) * _w(2)).sum()])
    return out


def test_a_tensor_sent_with_grad_mode_off_is_a_constant_and_its_sender_gets_no_gradient() -> None:
    results, codes = run_ranks(_cases, 2, timeout=120)
    assert codes == {0: 0, 1: 0}, (codes, results)
    (s0, sender), (s1, receiver) = results[0], results[1]
    assert s0 == "ok", sender
    assert s1 == "ok", receiver
    for execute in ("nodes", "waves"):
        for mode in MODES:
            case = f"{execute}/{mode}"
            # One process: the same graph, the tensor sent with grad mode off a constant.
            w, q = _w(1), _w(2)
            r = w.detach()
            ((r * (w * 3) * q).sum() + (r * q).sum()).backward()
            grads, leaf_grad = sender[f"peer {case}"]
            assert len(grads) == 1 and grads[0][0], (case, grads)
            assert grads[0][1] == w.grad.tolist(), (case, grads, w.grad)  # w * 3's alone
            assert leaf_grad == w.grad.tolist(), (case, leaf_grad)
            assert receiver[f"received {case}"] == (False, None, True), case
            assert receiver[f"peer {case}"] == q.grad.tolist(), (case, receiver)
            assert sender[f"self received {case}"] == (False, None), case
            ((is_v, gv),) = sender[f"self {case}"]  # v's gradient; nothing for w
            assert is_v and gv == w.tolist(), (case, gv)
    for out in (sender, receiver):
        assert "roots[0] does not require grad" in out["constant root"], out["constant root"]
    assert sender["after"] == (2 * _w(2)).tolist(), sender["after"]
