"""Misuse of a distributed autograd context: named on every rank at once, the group kept.

``diagnose`` is checked on literal records (every rule, and records that prove nothing);
then real gloo processes (world 3) misuse a context in each way, well under its timeout
every rank raises the same error naming the odd rank, and three good passes follow,
equal to one process's gradients (float64, 1e-12).
"""

from __future__ import annotations

import os
import time
from typing import Any

from ranks import run_ranks

from xgrad.torch_backend.dist_ledger import Record, diagnose

RANKS = [0, 1, 2]


def test_a_rank_that_left_before_the_others_pass_is_named() -> None:
    records = {0: Record("pass", 1), 1: Record("exit", 0), 2: Record("pass", 1)}
    assert diagnose(records, RANKS) == (
        1,
        "context exit",
        "left the context after calling backward 0 times, ranks 0, 2 once (every rank of "
        "the group calls backward the same number of times)",
    )


def test_a_rank_with_an_extra_pass_is_named_and_a_tie_names_the_extra_pass() -> None:
    records = {0: Record("exit", 1), 1: Record("pass", 2), 2: Record("exit", 1)}
    origin, where, message = diagnose(records, RANKS) or (None, "", "")
    assert (origin, where) == (1, "backward pass 2")
    assert message.startswith("called backward 2 times in this context, ranks 0, 2 once")
    # Two ranks, one pass each way: the rank with more passes is named; one that never
    # called backward is named before one that called it.
    assert diagnose({0: Record("exit", 1), 1: Record("pass", 2)}, [0, 1])[0] == 1  # type: ignore[index]
    assert diagnose({0: Record("pass", 1), 1: Record("exit", 0)}, [0, 1])[0] == 1  # type: ignore[index]


def test_nothing_is_proven_while_a_rank_is_unknown_or_may_still_act() -> None:
    assert diagnose({0: Record("pass", 1), 1: Record("exit", 0)}, RANKS) is None
    # Rank 2 finished pass 1, so rank 0's record of pass 1 is old.
    assert (
        diagnose({0: Record("pass", 1), 1: Record("exit", 1), 2: Record("exit", 1)}, RANKS) is None
    )
    # A receive waiting for a tensor its sender (still in the forward) may send.
    assert diagnose({0: Record("forward", 0), 1: Record("recv", 0, src=0)}, [0, 1]) is None
    # An old record of a receive whose tensor came since.
    recv = Record("recv", 0, recvd={0: 0}, src=0)
    assert diagnose({0: Record("exit", 0, sent={1: 1}), 1: recv}, [0, 1]) is None
    assert diagnose({r: Record("exit", 2) for r in RANKS}, RANKS) is None


def test_a_send_without_recv_and_a_recv_without_send_are_named() -> None:
    sender = Record("pass", 1, sent={1: 2}, gsent={1: 2})
    receiver = Record("pass", 1, recvd={0: 1}, grecvd={0: 1})
    assert diagnose({0: sender, 1: receiver}, RANKS) == (
        0,
        "backward pass 1",
        "sent rank 1 2 tensors in this context before this pass, rank 1 received 1 "
        "(a send with no matching recv)",
    )
    # Tensors that need no grad are only missed at the exit (a recv may follow a pass).
    sender = Record("pass", 1, sent={1: 1})
    assert diagnose({0: sender, 1: Record("pass", 1)}, RANKS) is None
    found = diagnose({0: Record("exit", 1, sent={1: 1}), 1: Record("exit", 1)}, [0, 1])
    assert found is not None and found[:2] == (0, "context exit")
    waiting = Record("recv", 0, recvd={2: 1}, src=2)
    assert diagnose({1: waiting, 2: Record("pass", 1, sent={1: 1})}, RANKS) == (
        1,
        "recv from rank 2",
        "waits for tensor 2 from rank 2, which sent it 1 in this context and is in backward "
        "pass 1 (a recv with no matching send)",
    )


def test_receives_that_wait_for_each_other_are_named_and_a_cycle_that_may_move_is_not() -> None:
    a = Record("recv", 0, recvd={1: 0}, src=1)
    b = Record("recv", 0, recvd={2: 0}, src=2)
    c = Record("recv", 0, recvd={0: 0}, src=0)
    assert diagnose({0: a, 1: b, 2: c}, RANKS) == (
        0,
        "recv from rank 1",
        "waits for tensor 1 from rank 1, and ranks 0 -> 1 -> 2 -> 0 each wait in a recv for "
        "a tensor the next has not sent (receives that wait for each other: a recv with no "
        "matching send before it)",
    )
    two = {1: Record("recv", 0, src=2), 2: Record("recv", 0, src=1)}
    assert diagnose(two, RANKS)[:2] == (1, "recv from rank 2")  # type: ignore[index]
    # Rank 1 already sent rank 0 the tensor it waits for: rank 0 will move on.
    moving = {0: a, 1: Record("recv", 0, sent={0: 1}, src=2), 2: c}
    assert diagnose(moving, RANKS) is None


def test_records_round_trip_through_bytes() -> None:
    r = Record("recv", 3, {1: 2}, {2: 1}, {1: 1}, {2: 1}, src=2)
    assert Record.from_bytes(r.to_bytes()) == r


FAST_HEARTBEAT = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}
TIMEOUT = 20.0


def _good(rank: int, da: Any) -> float:
    """Fan-in and a round trip on three ranks; the largest difference to one process."""
    import torch

    def params() -> dict[str, Any]:
        g = torch.Generator().manual_seed(0)
        return {k: torch.randn(3, generator=g, dtype=torch.float64).requires_grad_() for k in "abc"}

    p = params()
    with da.context(timeout=TIMEOUT) as cid:
        if rank == 0:
            da.send(p["a"] * 2, 1)
            r, s = da.recv(1), da.recv(2)
            da.backward(cid, [(r * s * p["a"]).sum()])
        elif rank == 1:
            da.send(da.recv(0) * p["b"], 0)
            da.backward(cid, [])
        else:
            da.send(p["c"].sin(), 0)
            da.backward(cid, [])
        got = da.get_gradients(cid)
    q = params()
    loss = (q["a"] * 2 * q["b"] * q["c"].sin() * q["a"]).sum()
    want = dict(zip("abc", torch.autograd.grad(loss, [q["a"], q["b"], q["c"]]), strict=True))
    mine = "abc"[rank]
    return float((got[p[mine]] - want[mine]).abs().max())


def _misuse(rank: int, world: int) -> dict[str, Any]:
    import torch

    from xgrad.torch_backend import dist_autograd as da

    os.environ.update(FAST_HEARTBEAT)
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)

    def never(cid: int) -> None:
        if rank != 1:
            da.backward(cid, [])

    def twice(cid: int) -> None:
        if rank == 0:
            da.send(w * 2, 1)
        loss = [da.recv(0).sum()] if rank == 1 else []
        da.backward(cid, loss, retain_graph=True)
        if rank == 1:
            da.backward(cid, loss)

    def unreceived(cid: int) -> None:
        if rank == 0:
            da.send(w * 2, 1)
        da.backward(cid, [])

    def unreceived_no_grad(cid: int) -> None:
        if rank == 0:
            da.send(torch.ones(2), 1)
        da.backward(cid, [])

    def never_sent(cid: int) -> None:
        if rank == 1:
            da.recv(2)
        da.backward(cid, [])

    def mutual(cid: int) -> None:  # ranks 0 and 1 each receive before they send
        if rank < 2:
            da.recv(1 - rank)
        da.backward(cid, [])

    out: dict[str, Any] = {"good": _good(rank, da)}
    for name, body in [
        ("mutual", mutual),
        ("never", never),
        ("twice", twice),
        ("unreceived", unreceived),
        ("unreceived_no_grad", unreceived_no_grad),
        ("never_sent", never_sent),
    ]:
        start = time.monotonic()
        try:
            with da.context(timeout=TIMEOUT) as cid:
                body(cid)
            got = "no error"
        except da.DistBackwardError as exc:
            got = f"{type(exc).__name__}: {exc}"
        out[name] = (got, time.monotonic() - start, [_good(rank, da) for _ in range(3)])
    return out


def test_misuse_is_named_on_every_rank_at_once_and_the_next_contexts_work() -> None:
    results, codes = run_ranks(_misuse, 3, timeout=150)
    assert all(code == 0 for code in codes.values()), (codes, results)
    outs = {}
    for rank in RANKS:
        status, out = results[rank]
        assert status == "ok", out
        outs[rank] = out
        assert out["good"] < 1e-12
    expected = {
        "never": "Error on rank 1 in context exit: left the context after calling backward "
        "0 times, ranks 0, 2 once",
        "twice": "Error on rank 1 in backward pass 2: called backward 2 times in this "
        "context, ranks 0, 2 once",
        "unreceived": "Error on rank 0 in backward pass 1: sent rank 1 1 tensor in this "
        "context before this pass, rank 1 received 0",
        "unreceived_no_grad": "Error on rank 0 in context exit: sent rank 1 1 tensor in this "
        "context, rank 1 received 0",
        "never_sent": "Error on rank 1 in recv from rank 2: waits for tensor 1 from rank 2, "
        "which sent it 0 in this context and is in backward pass 1",
        "mutual": "Error on rank 0 in recv from rank 1: waits for tensor 1 from rank 1, and "
        "ranks 0 -> 1 -> 0 each wait in a recv",
    }
    for name, text in expected.items():
        for rank in RANKS:
            got, elapsed, after = outs[rank][name]
            assert got.startswith("DistBackwardError: " + text), (name, rank, got)
            # The timeout is 20 s: the misuse is seen within a second or so (loaded machine).
            assert elapsed < 6.0, (name, rank, elapsed)
            assert max(after) < 1e-12, (name, rank, after)
