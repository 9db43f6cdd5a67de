"""A step one rank runs outside any distributed autograd context, on real gloo ranks.

Contexts pair up across ranks by the order each rank opens them. A rank whose ``send`` or
``recv`` ran outside a context (refused there with a ``RuntimeError`` its code caught)
opened its next context for the next step, which paired with the step its peers were
still in: the peers' step got this rank's next-step tensors and every later step was off
by one, all without a word. Now the refused call takes the group's next context as a
failed one on every rank, naming the rank and the call, and the following steps pair up
and give the right gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from ranks import run_ranks

TIMEOUT = 20.0
OUTSIDE = "must be called inside `with dist_autograd.context():` (rank {r} called it outside"


def _w(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, generator=g, dtype=torch.float64).requires_grad_()


def _steps(rank: int, world: int, odd: int, call: str) -> list[tuple[str, Any]]:
    """Three steps of ``rank 0 sends w * (step + 1), rank 1 differentiates sum(r * v)``;
    at step 0 rank ``odd`` first runs ``call`` outside any context (and catches it)."""
    from xgrad.torch_backend import dist_autograd as da

    w, v = _w(1), _w(2)
    out: list[tuple[str, Any]] = []
    for step in range(3):
        try:
            if step == 0 and rank == odd:
                if call == "send":
                    da.send(w * 5, 1 - rank)
                else:
                    da.recv(1 - rank)
            with da.context(timeout=TIMEOUT) as cid:
                if rank == 0:
                    da.send(w * (step + 1), 1)
                    da.backward(cid, [])
                    out.append(("ok", da.get_gradients(cid)[w].tolist()))
                else:
                    r = da.recv(0)
                    da.backward(cid, [(r * v).sum()])
                    out.append(("ok", [r.tolist(), da.get_gradients(cid)[v].tolist()]))
        except Exception as exc:
            out.append(("raised", f"{type(exc).__name__}: {exc}"))
    return out


def _check(odd: int, call: str) -> None:
    results, codes = run_ranks(_steps, 2, (odd, call), timeout=120)
    assert codes == {0: 0, 1: 0}, (codes, results)
    w, v = _w(1), _w(2)
    for rank in (0, 1):
        status, out = results[rank]
        assert status == "ok", out
        kind, text = out[0]
        assert kind == "raised", out
        if rank == odd:
            assert text.startswith(f"RuntimeError: {call} {OUTSIDE.format(r=odd)}"), text
        else:
            assert text.startswith(
                f"DistBackwardError: Error on rank {odd} in {call}: RuntimeError: {call} "
                + OUTSIDE.format(r=odd)
            ), text
        for step in (1, 2):
            r = (w * (step + 1)).tolist()
            want = (v * (step + 1)).tolist() if rank == 0 else [r, r]
            assert out[step] == ("ok", want), (rank, step, out)


def test_a_send_outside_any_context_fails_the_peers_step_and_the_next_steps_pair_up() -> None:
    _check(0, "send")


def test_a_recv_outside_any_context_fails_the_senders_pass_and_the_next_steps_pair_up() -> None:
    _check(1, "recv")
