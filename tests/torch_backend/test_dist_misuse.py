"""Distributed autograd where a user's program goes off the usual path, on two gloo ranks.

Each case gave silently wrong or missing gradients, or a failure a valid program should
not have, before:

* ``backward(cid, y)`` with a bare tensor (not a list) took each element of ``y`` as a
  root, i.e. differentiated ``y.sum()``; now refused as PyTorch refuses it;
* a gradient reaching a received tensor outside its context's distributed backward (a
  local ``loss.backward()``, another context's pass) was dropped and the sender got
  nothing; now it raises, naming the tensor's context and sender;
* a gradient that is a conjugate view (``r.conj()`` used downstream) could not be sent
  ("view is not supported for conjugate view tensors");
* a parameter sent under ``torch.inference_mode()`` failed in torch's internals (it is
  sent detached now, as under ``no_grad``: its sender gets no gradient,
  ``test_dist_grad_mode``), and a tensor received there required grad (an inference
  tensor: ``r * r`` was not tracked, ``r + w`` was, and the sender's gradient went
  missing without a word);
* a wait shorter than two heartbeat intervals named a slow live rank as having stopped
  answering.

After each error the next context gives the right gradients.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from ranks import run_ranks

TIMEOUT = 20.0


def _w(seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, generator=g, dtype=dtype).requires_grad_()


def _good_context(rank: int) -> list[float]:
    """A plain pass, after an error: rank 0 gets d/dw sum(2w * v) = 2v."""
    from xgrad.torch_backend import dist_autograd as da

    w, v = _w(1), _w(2)
    with da.context(timeout=TIMEOUT) as cid:
        if rank == 0:
            da.send(w * 2, 1)
            da.backward(cid, [])
            return list(da.get_gradients(cid)[w].tolist())
        da.backward(cid, [(da.recv(0) * v).sum()])
        return list(da.get_gradients(cid)[v].tolist())


def _error(step: Any) -> str:
    try:
        step()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _misuse(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import dist_autograd as da

    out: dict[str, Any] = {}
    w, v = _w(1), _w(2)

    def bare_roots() -> None:
        with da.context(timeout=TIMEOUT) as cid:
            if rank == 0:
                da.send(w * 2, 1)
                da.backward(cid, [])
            else:
                da.backward(cid, da.recv(0) * v)  # a tensor, not [loss]

    out["bare_roots"] = _error(bare_roots)
    out["after_bare_roots"] = _good_context(rank)

    def local_backward() -> None:
        with da.context(timeout=TIMEOUT) as cid:
            if rank == 0:
                da.send(w * 2, 1)
            else:
                (da.recv(0) * v).sum().backward()  # torch's engine, not the distributed one
            da.backward(cid, [])

    out["local_backward"] = _error(local_backward)
    out["after_local_backward"] = _good_context(rank)

    def other_context() -> None:
        with da.context(timeout=TIMEOUT) as cid:
            if rank == 0:
                da.send(w * 2, 1)
                da.backward(cid, [])
                kept = None
            else:
                kept = da.recv(0)
                da.backward(cid, [(kept * v).sum()], retain_graph=True)
        with da.context(timeout=TIMEOUT) as cid:  # the received tensor of the last one
            da.backward(cid, [] if kept is None else [(kept * v).sum()])

    out["other_context"] = _error(other_context)
    out["after_other_context"] = _good_context(rank)
    return out


def test_misused_roots_and_received_tensors_raise_on_every_rank_and_the_next_context_works() -> (
    None
):
    results, codes = run_ranks(_misuse, 2, timeout=120)
    assert codes == {0: 0, 1: 0}, (codes, results)
    w, v = _w(1), _w(2)
    good = {0: (2 * v).tolist(), 1: (2 * w).tolist()}
    for rank in (0, 1):
        status, out = results[rank]
        assert status == "ok", out
        assert out["bare_roots"] == (
            "DistBackwardError: Error on rank 1 in backward: TypeError: roots must be a list "
            "of scalar tensors (roots=[loss]), got a tensor of shape (3,)"
        ), out
        for case, where in (("local_backward", "forward"), ("other_context", "RecvBackward")):
            text = out[case]
            if case == "local_backward" and rank == 1:
                # In the context's body: the rank that raised gets its own exception back.
                text = text.replace("", f"DistBackwardError: Error on rank 1 in {where}: ", 1)
            assert text.startswith(
                f"DistBackwardError: Error on rank 1 in {where}: RuntimeError: a gradient "
                "reached the tensor received by rank 1 from rank 0 in context "
            ), (case, out[case])
            assert "outside that context's dist_autograd.backward" in text, text
        for case in ("bare_roots", "local_backward", "other_context"):
            assert out[f"after_{case}"] == good[rank], (case, out)


def _sends(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import dist_autograd as da

    out: dict[str, Any] = {}
    w, c = _w(1, torch.complex128), _w(2, torch.complex128)
    with da.context(timeout=TIMEOUT) as cid:  # the gradient sent back is a conjugate view
        if rank == 0:
            da.send(w * 2, 1)
            da.backward(cid, [])
            out["conj"] = da.get_gradients(cid)[w]
        else:
            da.backward(cid, [(da.recv(0).conj() * c).real.sum()])
    p, q = _w(3), _w(4)
    with da.context(timeout=TIMEOUT) as cid:  # a parameter sent under inference mode
        if rank == 0:
            with torch.inference_mode():
                da.send(p, 1)
            da.backward(cid, [])
            out["inference"] = dict(da.get_gradients(cid))
        else:
            r = da.recv(0)
            out["inference"] = r.requires_grad
            da.backward(cid, [(r * q).sum()])
            out["inference q"] = da.get_gradients(cid)[q]
    with da.context(timeout=TIMEOUT) as cid:  # a tensor received under inference mode
        if rank == 0:
            da.send(p * 2, 1)
            da.backward(cid, [])
            out["sender"] = dict(da.get_gradients(cid))
        else:
            with torch.inference_mode():
                r = da.recv(0)
            out["received"] = (r.requires_grad, r.grad_fn)
            da.backward(cid, [(r * r).sum() + (r + q).sum()])
            out["receiver"] = da.get_gradients(cid)[q]
    return out


def test_a_conjugate_gradient_and_inference_mode_sends_and_recvs_give_one_process_gradients() -> (
    None
):
    results, codes = run_ranks(_sends, 2, timeout=120)
    assert codes == {0: 0, 1: 0}, (codes, results)
    status, out = results[0]
    assert status == "ok", out
    w, c = _w(1, torch.complex128), _w(2, torch.complex128)
    ((w * 2).conj() * c).real.sum().backward()
    assert torch.equal(out["conj"], w.grad), (out["conj"], w.grad)
    # Sent detached, as with grad mode off (PyTorch's RPC attaches no autograd then): no
    # gradient for the sender, a constant on the receiver.
    assert out["inference"] == {}, out["inference"]
    # Received under inference mode: no gradient, as for anything made there (it came out
    # requiring one, an inference tensor whose ops were tracked or not by their kind, and
    # the sender's gradient went missing without a word).
    assert out["sender"] == {}, out["sender"]
    status, theirs = results[1]
    assert status == "ok", theirs
    assert theirs["received"] == (False, None), theirs
    assert theirs["inference"] is False, theirs
    assert torch.equal(theirs["inference q"], _w(3).detach()), theirs
    assert torch.equal(theirs["receiver"], torch.ones(3, dtype=torch.float64))


def _slow(rank: int, world: int) -> str:
    from xgrad.torch_backend import dist_autograd as da

    def step() -> None:
        with da.context(timeout=0.3) as cid:
            if rank == 1:
                time.sleep(0.8)  # alive, beating, only slow
                da.send(_w(1) * 2, 0)
                da.backward(cid, [])
            else:
                da.backward(cid, [(da.recv(1) * _w(2)).sum()])

    return _error(step)


def test_a_wait_too_short_for_the_heartbeats_does_not_call_a_slow_rank_stopped() -> None:
    results, _ = run_ranks(_slow, 2, timeout=60)
    status, text = results[0]
    assert status == "ok", text
    assert "stopped answering" not in text, text
    assert "timed out after 0.3 s (too short a wait to tell from the heartbeats" in text, text


class _Busy(torch.autograd.Function):
    """Identity whose backward, on a rank that sets ``seconds``, sleeps (a user's function
    stuck in its own work: the rank still beats and waits for no rank)."""

    seconds = 0.0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        time.sleep(_Busy.seconds)
        return g


def _busy(rank: int, world: int) -> dict[str, Any]:
    """A chain 0 -> 1 -> 2; rank 1's backward outlasts the context's timeout."""
    from xgrad.torch_backend import dist_autograd as da

    os.environ["XGRAD_HEARTBEAT_TIMEOUT"] = "2"  # how long a closed pair's peers are read
    _Busy.seconds = 4.0 if rank == 1 else 0.0
    w = _w(rank)
    out: dict[str, Any] = {}

    def step(timeout: float) -> None:
        with da.context(timeout=timeout) as cid:
            if rank == 0:
                da.send(w * 2, 1)
                da.backward(cid, [])
            elif rank == 1:
                da.send(_Busy.apply(da.recv(0) * w), 2)
                da.backward(cid, [])
            else:
                da.backward(cid, [(da.recv(1) * w).sum()])

    try:
        step(2.5)
        out["error"] = "no error"
    except Exception as exc:
        out["error"], out["origin"] = str(exc), getattr(exc, "rank", None)
    _Busy.seconds = 0.0
    out["next"] = _error(lambda: step(TIMEOUT))  # on the group the timeout closed
    return out


def test_a_rank_busy_in_its_own_backward_is_named_not_the_rank_that_waited() -> None:
    """Was "Error on rank 0 in backward, gradients from ranks [1, 2]: timed out" on ranks 0
    and 2: the waiting rank blamed, as the busy one still beats. The waits are published
    with the heartbeats, and a timeout follows them to the live rank that waits for none.
    (A receive that ran out its timeout closed the group's connections: the group is lost,
    as the README says; the next context says so rather than naming a live rank.)"""
    results, codes = run_ranks(_busy, 3, timeout=90)
    assert codes == {0: 0, 1: 0, 2: 0}, (codes, results)
    for rank in range(3):
        status, out = results[rank]
        assert status == "ok", out
        assert out["origin"] == 1, (rank, out)
        assert out["error"].startswith("Error on rank 1: did not answer within the timeout: "), out
        assert "it waits for no rank: busy in its own code" in out["error"], out
        # Every rank alive: the group's closed connection is said, no rank is named as
        # stopped (was "Error on rank 1: stopped answering ... pair closure").
        assert "the group's connection was closed earlier" in out["next"], out
        assert "stopped answering" not in out["next"], out
