"""Distributed autograd across real gloo processes: gradients equal one process's, failures named.

Each rank makes every rank's parameters from one seed, computes the whole graph in one
process with ``torch.autograd.grad`` (the reference), then runs its own part with
``xgrad.torch_backend.dist_autograd`` and compares its leaves' gradients (float64).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from failing import failing_function
from ranks import run_ranks

FAST_HEARTBEAT = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}


def _params() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)

    def p(*shape: int) -> Any:
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    return {
        "x": p(4, 3), "W0": p(3, 3), "w0": p(3), "u0": p(3),
        "w1": p(3), "w2": p(3), "w3": p(3),
    }  # fmt: skip


OWNED = {0: ("x", "W0", "w0", "u0"), 1: ("w1",), 2: ("w2",), 3: ("w3",)}


def _fan(rank: int, P: dict[str, Any], da: Any, cid: int) -> None:
    """Fan-out (0 to 1, 2), the same tensor sent twice, fan-in (1, 2 to 3), an unused recv."""
    import torch

    roots = []
    if rank == 0:
        h = torch.tanh(P["x"] @ P["W0"])
        da.send(h, 1)
        da.send(h, 2)
        da.send(h, 1)
        da.send(P["u0"] * 2, 2)  # rank 2 ignores it: its gradient is "none"
        roots = [(h**2).sum()]
    elif rank == 1:
        a, b = da.recv(0), da.recv(0)
        da.send(torch.sin(a * P["w1"]) + b, 3)
    elif rank == 2:
        c = da.recv(0)
        da.recv(0)
        da.send(c * P["w2"], 3)
    else:
        p, q = da.recv(1), da.recv(2)
        roots = [(p * q * P["w3"]).sum()]
    da.backward(cid, roots)


def _fan_reference(P: dict[str, Any]) -> Any:
    import torch

    h = torch.tanh(P["x"] @ P["W0"])
    y1 = torch.sin(h * P["w1"]) + h
    return (h**2).sum() + (y1 * (h * P["w2"]) * P["w3"]).sum()


def _round_trip(rank: int, P: dict[str, Any], da: Any, cid: int) -> None:
    """0 -> 1 -> 0 and back again; ranks 2 and 3 take no part but call backward."""
    import torch

    roots = []
    if rank == 0:
        a = P["x"] * P["w0"]
        da.send(a, 1)
        c, d = da.recv(1), da.recv(1)
        roots = [(c * P["w0"]).sum() + (a * a).sum(), d.sum()]
    elif rank == 1:
        r = da.recv(0)
        da.send(torch.tanh(r) * P["w1"], 0)
        da.send(r * r, 0)
    da.backward(cid, roots)


def _round_trip_reference(P: dict[str, Any]) -> Any:
    import torch

    a = P["x"] * P["w0"]
    c = torch.tanh(a) * P["w1"]
    return (c * P["w0"]).sum() + (a * a).sum() + (a * a).sum()


def _relay(rank: int, P: dict[str, Any], da: Any, cid: int) -> None:
    """A leaf sent as it is (0 to 1), a received tensor passed on as it is (1 to 2)."""
    roots = []
    if rank == 0:
        da.send(P["w0"], 1)
    elif rank == 1:
        r = da.recv(0)
        da.send(r, 2)
        roots = [(r * P["w1"]).sum()]
    elif rank == 2:
        roots = [(da.recv(1) * P["w2"]).sum() * 3]
    da.backward(cid, roots)


def _relay_reference(P: dict[str, Any]) -> Any:
    return (P["w0"] * P["w1"]).sum() + (P["w0"] * P["w2"]).sum() * 3


GRAPHS = {
    "fan": (_fan, _fan_reference),
    "round_trip": (_round_trip, _round_trip_reference),
    "relay": (_relay, _relay_reference),
}


def _run_graph(rank: int, name: str, **context: Any) -> float:
    """Run graph ``name``; the largest difference to the one-process gradients of my leaves."""
    import torch

    from xgrad.torch_backend import dist_autograd as da

    part, reference = GRAPHS[name]
    P = _params()
    mine = [P[k] for k in OWNED[rank]]
    expected = torch.autograd.grad(reference(P), mine, allow_unused=True)
    with da.context(**context) as cid:
        part(rank, P, da, cid)
        got = da.get_gradients(cid)
    worst = 0.0
    for leaf, want in zip(mine, expected, strict=True):
        if want is None or not want.any():
            assert leaf not in got or not got[leaf].any(), "a gradient where none flows"
            continue
        worst = max(worst, float((got[leaf] - want).abs().max()))
    return worst


def _note_boom_time() -> None:
    os.environ["BOOM_AT"] = repr(time.time())


Boom = failing_function("Boom", lambda: ValueError("boom in backward"), _note_boom_time)


def _failures(rank: int, world: int) -> dict[str, Any]:
    """Good passes, then failures of every kind, each followed by good passes."""
    import torch

    from xgrad.torch_backend import dist_autograd as da

    os.environ.update(FAST_HEARTBEAT)
    out: dict[str, Any] = {"good": [_run_graph(rank, name) for name in GRAPHS]}
    # The waves in torch's engine (the default runs the node engine), the failures too;
    # a pass whose leaves have hooks (below) runs on the node engine either way.
    default, da.EXECUTE = da.EXECUTE, "waves" if da.EXECUTE == "nodes" else "nodes"
    out["good"] += [_run_graph(rank, name) for name in GRAPHS]
    out["bad"] = _bad_input(rank, da)
    # Two passes through one graph with retain_graph: the context accumulates both.
    P = _params()
    with da.context() as cid:
        if rank == 0:
            da.send(P["w0"] * 3, 1)
        loss = [da.recv(0).sum()] if rank == 1 else []
        da.backward(cid, loss, retain_graph=True)
        da.backward(cid, loss)
        if rank == 0:
            out["twice"] = da.get_gradients(cid)[P["w0"]].tolist()
        try:
            da.backward(cid, loss)
        except RuntimeError as exc:
            out["third"] = str(exc)
        # A send after the backward passes: the context still waits for it at its exit.
        if rank == 0:
            da.send(torch.full((2,), 5.0), 1)
        if rank == 1:
            out["late"] = da.recv(0).tolist()

    def attempt(name: str, body: Any) -> None:
        start = time.time()
        try:
            with da.context(timeout=20) as cid:
                body(cid)
        except Exception as exc:  # the origin of a forward failure raises its own error
            failed_at = float(os.environ.pop("BOOM_AT", "nan"))
            origin = exc.rank if isinstance(exc, da.DistBackwardError) else rank
            out[name] = (f"{type(exc).__name__}: {exc}", origin, time.time(), start, failed_at)
            return
        out[name] = ("no error", -1, time.time(), start, float("nan"))

    def node_fails(cid: int) -> None:
        P = _params()
        if rank == 1:
            y = Boom.apply(P["w1"] * 2)
            da.send(y, 0)
            da.backward(cid, [])
        elif rank == 0:
            r = da.recv(1)
            da.backward(cid, [(r * P["w0"]).sum()])
        else:
            da.backward(cid, [])

    def forward_fails(cid: int) -> None:
        if rank == 2:
            raise KeyError("no such layer")
        if rank == 0:
            da.recv(2)
        da.backward(cid, [])

    def hook_fails(cid: int) -> None:
        P = _params()
        if rank == 3:
            P["w3"].register_hook(lambda g: 1 / 0)
            da.send(P["w3"] * 3, 0)
        if rank == 0:
            da.backward(cid, [da.recv(3).sum()])
        else:
            da.backward(cid, [])

    def bad_roots(cid: int) -> None:
        P = _params()
        da.backward(cid, [P["x"] * 2] if rank == 0 else [])

    for name, body in [
        ("node", node_fails),
        ("forward", forward_fails),
        ("hook", hook_fails),
        ("roots", bad_roots),
    ]:
        attempt(name, body)
        out[f"after_{name}"] = [_run_graph(rank, "fan") for _ in range(3 if name == "node" else 1)]
    # The transfers failed passes left are kept until gloo is done with them, then freed.
    from xgrad.torch_backend import dist_graveyard

    time.sleep(0.5)
    buried = len(dist_graveyard.GRAVEYARD)
    kept = dist_graveyard.sweep()
    pending = all(not work.is_completed() for work, _ in dist_graveyard.GRAVEYARD)
    out["graveyard"] = (buried, kept, pending)
    da.EXECUTE = default
    # The same tensor in .grad, for ordinary optimizers.
    P = _params()
    with da.context() as cid:
        if rank == 0:
            da.send(P["w0"] * 2, 1)
            da.backward(cid, [], accumulate_grad=True)
            out["grad"] = P["w0"].grad.tolist()
            out["context"] = da.get_gradients(cid)[P["w0"]].tolist()
        elif rank == 1:
            da.backward(cid, [da.recv(0).sum()], accumulate_grad=True)
        else:
            da.backward(cid, [], accumulate_grad=True)
    del torch
    return out


def _bad_input(rank: int, da: Any) -> list[str]:
    """Each misuse raises at once on its own rank, naming the argument and value."""
    import torch

    errors = []

    def expect(call: Any) -> None:
        try:
            call()
        except (TypeError, ValueError, RuntimeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        else:
            errors.append("no error")

    t = torch.ones(2)
    expect(lambda: da.send(t, 1))  # outside a context
    expect(lambda: da.context(timeout=float("nan")).__enter__())
    expect(lambda: da.get_gradients(12345))
    with da.context() as cid:
        expect(lambda: da.recv(rank))  # nothing sent to itself yet
        expect(lambda: da.send(t, 7))
        expect(lambda: da.recv("0"))
        expect(lambda: da.send([1.0], 0 if rank else 1))
        da.backward(cid, [])
    return errors


def test_gradients_equal_one_process_and_every_failure_reaches_every_rank() -> None:
    results, codes = run_ranks(_failures, 4, timeout=240)
    assert all(code == 0 for code in codes.values()), (codes, results)
    for rank in range(4):
        status, out = results[rank]
        assert status == "ok", out
        for key in ("good", "after_node", "after_forward", "after_hook", "after_roots"):
            assert max(out[key]) < 1e-12, (rank, key, out[key])
        assert len(out["after_node"]) == 3
        assert out["graveyard"][2], (rank, out["graveyard"])  # only transfers still in flight
    # Some of what the failures left completed (the poisons peers were waiting for) and is freed.
    assert sum(results[r][1]["graveyard"][0] - results[r][1]["graveyard"][1] for r in range(4)) > 0
    boom = results[1][1]["node"][4]
    for rank in range(4):
        out = results[rank][1]
        msg, origin, raised_at, _, _ = out["node"]
        assert msg.startswith(
            "DistBackwardError: Error on rank 1 in BoomBackward: ValueError: boom in backward"
        )
        assert origin == 1
        assert raised_at - boom < 2.0, (rank, raised_at - boom)
        msg, origin, raised_at, start, _ = out["forward"]
        if rank == 2:
            assert msg == "KeyError: 'no such layer'"
        else:
            assert msg.startswith("DistBackwardError: Error on rank 2 in forward: KeyError"), msg
        assert raised_at - start < 2.0 + 3.0  # the failing rank's own start, on a loaded machine
        msg, origin, _, _, _ = out["hook"]
        assert msg.startswith(
            "DistBackwardError: Error on rank 3 in AccumulateGrad: ZeroDivisionError"
        ), msg
        msg, origin, _, _, _ = out["roots"]
        assert msg.startswith(
            "DistBackwardError: Error on rank 0 in backward: ValueError: roots[0] has shape (4, 3)"
        )
    for rank in range(4):
        bad = results[rank][1]["bad"]
        # Every rank sent outside a context: each spends the group's next context, the
        # same one on every rank, so the contexts after still pair up (the passes below).
        assert bad[0].startswith(
            "RuntimeError: send must be called inside `with dist_autograd.context():` "
            f"(rank {rank} called it outside any context: the default group's context "
        ), bad[0]
        assert bad[1].startswith("ValueError: timeout=nan must be a positive, finite")
        assert bad[2].startswith(
            "UnknownContextError: Could not find autograd context with id: 12345 (context_id="
        )
        assert bad[3].startswith(f"RuntimeError: recv(src={rank}) on rank {rank}: this rank has")
        assert bad[4].startswith("ValueError: dst=7 is not a rank of the context's group")
        assert bad[5] == "TypeError: src='0' must be an int rank"
        assert bad[6] == "TypeError: tensor is a list, not a torch.Tensor"
    assert results[0][1]["twice"] == pytest.approx([6.0, 6.0, 6.0])
    assert "without retain_graph=True" in results[0][1]["third"]
    assert results[1][1]["late"] == [5.0, 5.0]
    assert results[0][1]["grad"] == results[0][1]["context"]
    assert results[0][1]["grad"] == pytest.approx([2.0, 2.0, 2.0])


def _lost_rank(rank: int, world: int, how: str) -> tuple[str, int, float]:
    """Rank ``world - 1`` dies or freezes after the forward pass; the others time the error."""
    from xgrad.torch_backend import dist_autograd as da

    os.environ.update(FAST_HEARTBEAT)
    P = _params()
    last = world - 1
    with da.context(timeout=20) as cid:
        if rank == last:
            da.send(P["w1"] * 2, 0)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        start = time.monotonic()
        try:
            da.backward(cid, [da.recv(last).sum()] if rank == 0 else [])
        except da.DistBackwardError as exc:
            return str(exc), exc.rank, time.monotonic() - start
    return "no error", -1, time.monotonic() - start


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_rank_is_named_within_the_timeout_and_the_others_exit(how: str) -> None:
    world = 3 if how == "kill" else 2
    results, codes = run_ranks(_lost_rank, world, args=(how,), timeout=90, frozen=[world - 1])
    for rank in range(world - 1):
        status, value = results[rank]
        assert status == "ok", value
        msg, origin, elapsed = value
        assert msg.startswith(f"Error on rank {world - 1}: stopped answering"), msg
        assert origin == world - 1
        assert elapsed < 2.0 + 8.0  # heartbeat timeout 2 s, on a loaded machine
        assert codes[rank] == 0


def _killed_on_entry(rank: int, world: int) -> list[tuple[str, int]]:
    """Rank 1 of 3 dies entering a context in which rank 0 sends to it and rank 2 sends to
    rank 0, needing its gradient back."""
    import torch

    from xgrad.torch_backend import dist_autograd as da

    os.environ.update(FAST_HEARTBEAT)
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    try:
        with da.context(timeout=20) as cid:
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 2:
                da.send(torch.tanh(w), 0)
            roots = []
            if rank == 0:
                da.send(w * 2, 1)
                roots = [(da.recv(2) * w).sum()]
            da.backward(cid, roots)
    except da.DistBackwardError as exc:
        return [(str(exc), exc.rank)]
    return [("no error", -1)]


def test_a_rank_killed_on_entry_is_named_not_the_rank_whose_transfer_failed() -> None:
    # Gloo failed the survivors' transfers at once ("Connection closed by peer"); each
    # was posted as the failure of the rank that saw it, before rank 1's heartbeat was
    # seen stopped: "Error on rank 0: RuntimeError: ... Connection closed by peer".
    for _ in range(3):
        results, codes = run_ranks(_killed_on_entry, 3, timeout=90, frozen=[1])
        for rank in (0, 2):
            status, [(msg, origin)] = results[rank]
            assert status == "ok", msg
            assert msg.startswith("Error on rank 1: stopped answering"), (rank, msg)
            assert origin == 1 and codes[rank] == 0, (rank, codes)


def _threads(rank: int, world: int) -> dict[str, Any]:
    """Contexts from two threads: on one group refused at once; on a group each, correct."""
    import threading

    import torch
    import torch.distributed as dist

    from xgrad.torch_backend import dist_autograd as da

    out: dict[str, Any] = {}

    def pass_on(group: Any, scale: float) -> list[float]:
        w = torch.full((3,), scale, dtype=torch.float64, requires_grad=True)
        with da.context(group=group, timeout=20) as cid:
            if rank == 0:
                da.send(w * 2, 1)
                da.backward(cid, [])
                return list(da.get_gradients(cid)[w].tolist())
            da.backward(cid, [(da.recv(0) * scale).sum()])
            return []

    # One group, two threads: the second to open a context on it is refused at once.
    opened, refused = threading.Event(), threading.Event()

    def second() -> None:
        opened.wait(10)
        start = time.monotonic()
        try:
            with da.context():
                out["second"] = "no error"
        except RuntimeError as exc:
            out["second"] = str(exc)
        out["second_took"] = time.monotonic() - start
        refused.set()

    t = threading.Thread(target=second)
    t.start()
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    with da.context(timeout=20) as cid:
        opened.set()
        refused.wait(10)
        # Nested in the same thread: refused as PyTorch does; the open context still works.
        try:
            with da.context():
                out["nested"] = "no error"
        except RuntimeError as exc:
            out["nested"] = str(exc)
        if rank == 0:
            da.send(w * 3, 1)
        da.backward(cid, [da.recv(0).sum()] if rank == 1 else [])
        if rank == 0:
            out["first"] = da.get_gradients(cid)[w].tolist()
    t.join(10)
    # A group per thread: contexts opened concurrently, in a different order on each rank.
    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    got: dict[int, list[float]] = {}

    def worker(i: int) -> None:
        time.sleep(0.3 * (i if rank == 0 else 1 - i))
        for _ in range(3):
            got[i] = pass_on(groups[i], [1.0, 10.0][i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    out["per_group"] = got
    return out


def test_contexts_need_a_group_per_thread_and_do_not_nest() -> None:
    results, codes = run_ranks(_threads, 2, timeout=90)
    assert all(code == 0 for code in codes.values()), (codes, results)
    for rank in range(2):
        status, out = results[rank]
        assert status == "ok", out
        assert out["second"].startswith("process group '0' already has a distributed autograd")
        assert "one process group per thread" in out["second"], out["second"]
        assert out["second_took"] < 2.0
        assert out["nested"].startswith("Already have an autograd context id for this thread")
    assert results[0][1]["first"] == [3.0, 3.0, 3.0]
    # Each group's gradient is its own: 2 * 1 and 2 * 10, not swapped.
    assert results[0][1]["per_group"] == {0: [2.0, 2.0, 2.0], 1: [20.0, 20.0, 20.0]}
