"""Where ``dist_autograd`` behaves as PyTorch's RPC ``torch.distributed.autograd`` does.

- An unknown context id raises an error that is a ``RuntimeError`` (PyTorch's "Could not
  find autograd context with id: ...") and a ``ValueError`` (a bad argument, as before).
- With ``accumulate_grad=True`` each leaf's post-accumulate-grad hooks run once per pass,
  after its ``.grad`` was written, as PyTorch's AccumulateGrad runs them; a hook that
  raises is reported on every rank.
- A rank may send to itself, as PyTorch's RPC may call itself: the gradient of the
  matching ``recv`` flows back to the ``send`` in the same pass; a self-send never received
  or a receive from itself with nothing sent is named, and the next context is clean.
- A received tensor is not a leaf (its ``grad_fn`` is ``RecvBackward``, as PyTorch's is
  ``RecvRpcBackward``): in-place ops on it work, and its hooks and ``retain_grad`` see its
  gradient as PyTorch's engine runs them. A sent tensor changed in place after the send
  gets the gradient of what was sent.
- Hooks on a sent tensor and on a root run once, on the summed gradient, on both engines.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ranks import run_ranks

from xgrad.torch_backend import dist_autograd as da

FAST_HEARTBEAT = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}


def _outs(fn: Any, world: int = 2, args: tuple[Any, ...] = ()) -> list[Any]:
    """What ``fn`` returned on each rank; every rank exited cleanly with a result."""
    results, codes = run_ranks(fn, world, args, timeout=90)
    assert all(code == 0 for code in codes.values()), (codes, results)
    assert [results[r][0] for r in range(world)] == ["ok"] * world, results
    return [results[r][1] for r in range(world)]


@pytest.mark.parametrize("call", ["get_gradients", "backward"])
def test_an_unknown_context_id_is_a_runtime_error_and_a_value_error(call: str) -> None:
    with pytest.raises(RuntimeError) as caught:  # what code written for PyTorch catches
        if call == "get_gradients":
            da.get_gradients(12345)
        else:
            da.backward(12345, [])
    assert isinstance(caught.value, ValueError)  # what xgrad's callers catch
    assert type(caught.value).__name__ == "UnknownContextError"
    assert str(caught.value).startswith("Could not find autograd context with id: 12345 (")


def test_is_available_and_is_valid_context_answer_as_pytorch_s_do() -> None:
    assert da.is_available() is True  # c10d is enough: no RPC framework needed
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 777"):
        da._is_valid_context(777)


def _next_context(rank: int, w: torch.Tensor) -> list[float] | None:
    """A clean context after the failures: rank 0's gradient of ``w`` (4 per element)."""
    with da.context(timeout=20) as cid:
        da._is_valid_context(cid)  # an open context: no error
        if rank == 0:
            da.send(w * 4, 1)
            da.backward(cid, [])
            return da.get_gradients(cid)[w].tolist()  # type: ignore[no-any-return]
        da.backward(cid, [da.recv(0).sum()])
    return None


def _post_accumulate(rank: int, world: int) -> dict[str, Any]:
    """Passes with accumulate_grad on both engines; then a hook that raises."""
    os.environ.update(FAST_HEARTBEAT)
    out: dict[str, Any] = {}
    for execute in ("nodes", "waves"):
        da.EXECUTE = execute
        w = torch.full((3,), 1.0, dtype=torch.float64, requires_grad=True)
        seen: list[tuple[str, list[float]]] = []

        def hook(p: torch.Tensor, seen: list[Any] = seen) -> None:
            assert p.grad is not None
            seen.append(("post", p.grad.tolist()))

        w.register_post_accumulate_grad_hook(hook)
        w.register_post_accumulate_grad_hook(lambda p, seen=seen: seen.append(("second", [])))
        with da.context(timeout=20) as cid:
            if rank == 0:
                y = w * 2
                da.send(y, 1)
                da.send(y, 1)  # two paths to w: its hooks still run once a pass
                loss = [(w * 3).sum()]
            else:
                loss = [(da.recv(0) + da.recv(0) * 10).sum() + (w * 5).sum()]
            da.backward(cid, loss, retain_graph=True, accumulate_grad=True)
            da.backward(cid, loss, retain_graph=True, accumulate_grad=True)
            da.backward(cid, loss)  # not accumulated into .grad: no hook
        out[execute] = seen
    # A post-accumulate hook that raises: its rank names it, the other hears of it.
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    if rank == 0:
        w.register_post_accumulate_grad_hook(lambda p: 1 / 0)
    try:
        with da.context(timeout=20) as cid:
            if rank == 0:
                da.send(w * 2, 1)
                da.backward(cid, [], accumulate_grad=True)
            else:
                da.backward(cid, [da.recv(0).sum()], accumulate_grad=True)
    except da.DistBackwardError as exc:
        out["failed"] = (str(exc), exc.rank)
    else:
        out["failed"] = ("no error", -1)
    out["after"] = _next_context(rank, w)
    return out


def test_post_accumulate_grad_hooks_run_once_per_leaf_per_pass_after_grad() -> None:
    outs = _outs(_post_accumulate)
    # rank 0: d/dw = 3 + 2 + 20 = 25 a pass; rank 1: 5. .grad is written before the hooks.
    for rank, per_pass in ((0, 25.0), (1, 5.0)):
        for execute in ("nodes", "waves"):
            assert outs[rank][execute] == [
                ("post", [per_pass] * 3),
                ("second", []),
                ("post", [2 * per_pass] * 3),
                ("second", []),
            ], (rank, execute)
    for rank in range(2):
        msg, origin = outs[rank]["failed"]
        assert msg.startswith("Error on rank 0 in AccumulateGrad: ZeroDivisionError"), msg
        assert origin == 0
    assert outs[0]["after"] == [4.0, 4.0, 4.0]


def _self_send(rank: int, world: int) -> dict[str, Any]:
    """0 sends to itself and to 1, 1 answers; then misuse of a send to oneself."""
    os.environ.update(FAST_HEARTBEAT)
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(3, generator=g, dtype=torch.float64).requires_grad_()
    a = w * 3
    r = a * 2
    reference = (a * (torch.sin(r) * v)).sum() + (r * v).sum()
    want = torch.autograd.grad(reference, [w, v])
    for execute in ("nodes", "waves"):
        da.EXECUTE = execute
        with da.context(timeout=20) as cid:
            if rank == 0:
                t = w * 3
                da.send(t, 0)
                t.detach().fill_(7.0)  # after the call: not what is received
                da.send(w * 6, 1)
                b = da.recv(0)
                out[f"snapshot_{execute}"] = bool(torch.equal(b.detach(), (w * 3).detach()))
                out[f"grad_fn_{execute}"] = b.grad_fn is not None
                c = da.recv(1)
                da.backward(cid, [(b * c).sum()])
                got = da.get_gradients(cid)[w]
                out[execute] = float((got - want[0]).abs().max())
            else:
                r1 = da.recv(0)
                da.send(torch.sin(r1) * v, 0)
                da.backward(cid, [(r1 * v).sum()])
                out[execute] = float((da.get_gradients(cid)[v] - want[1]).abs().max())
    # recv from oneself with nothing sent: refused at once, the context goes on.
    with da.context(timeout=20) as cid:
        try:
            da.recv(rank)
        except RuntimeError as exc:
            out["empty"] = str(exc)
        da.backward(cid, [])
    # A send to oneself never received: named on every rank at the exit.
    try:
        with da.context(timeout=20) as cid:
            if rank == 1:
                da.send(w * 2, 1)
            da.backward(cid, [])
    except Exception as exc:
        origin = exc.rank if isinstance(exc, da.DistBackwardError) else rank
        out["unreceived"] = (f"{type(exc).__name__}: {exc}", origin)
    else:
        out["unreceived"] = ("no error", -1)
    out["after"] = _next_context(rank, w)
    return out


def test_a_rank_may_send_to_itself_and_the_gradient_flows_in_the_same_pass() -> None:
    outs = _outs(_self_send)
    for rank in range(2):
        for execute in ("nodes", "waves"):
            assert outs[rank][execute] < 1e-12, (rank, execute, outs[rank][execute])
        assert outs[rank]["empty"].startswith(f"recv(src={rank}) on rank {rank}: this rank has")
        msg, origin = outs[rank]["unreceived"]
        assert origin == 1
        tail = "rank 1 sent itself 1 tensor(s) in this context that it did not receive"
        assert tail in msg, msg
        if rank == 0:
            assert msg.startswith("DistBackwardError: Error on rank 1 in forward: RuntimeError")
    assert outs[0]["snapshot_nodes"] and outs[0]["snapshot_waves"]
    assert outs[0]["grad_fn_nodes"] and outs[0]["grad_fn_waves"]
    assert outs[0]["after"] == [4.0, 4.0, 4.0]


_W = torch.tensor([1.0, 2.0, -0.5], dtype=torch.float64)


def _each_engine() -> Iterator[tuple[str, torch.Tensor]]:
    """Each way to run a rank's graph in turn, with a fresh leaf ``w``."""
    for execute in ("nodes", "waves"):
        da.EXECUTE = execute
        yield execute, _W.clone().requires_grad_()


def _in_place_remote(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    """Rank 1's part of :func:`_in_place`: what it does with the two tensors it received."""
    t1.register_hook(lambda g: g * 10)
    t1.retain_grad()
    t2.register_hook(lambda g: g * 7)  # registered before the in-place ops
    t2.mul_(2)
    t2.add_(1)
    return (t1 * t1).sum() + (t2 * t2).sum()


def _in_place_local(w: torch.Tensor) -> list[float]:
    """The graph of :func:`_in_place` in one process (a received tensor is a clone):
    the gradient of ``w``."""
    y = w * 3
    t1, t2 = y.clone(), (y * 2).clone()
    y.mul_(5)
    loss = y.sum() + _in_place_remote(t1, t2)
    loss.backward()
    assert w.grad is not None
    return w.grad.tolist()  # type: ignore[no-any-return]


def _in_place(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 sends ``w * 3`` and ``w * 6`` then scales its own copy in place; rank 1
    changes what it received in place, with hooks registered before (and retain_grad)."""
    out: dict[str, Any] = {}
    for execute, w in _each_engine():
        with da.context(timeout=20) as cid:
            if rank == 0:
                y = w * 3
                da.send(y, 1)
                da.send(y * 2, 1)
                y.mul_(5)  # after the send: what was sent is w * 3
                da.backward(cid, [y.sum()])
                out[execute] = {"w": da.get_gradients(cid)[w].tolist()}
            else:
                t1, t2 = da.recv(0), da.recv(0)
                out[f"leaf_{execute}"] = (t1.is_leaf, type(t1.grad_fn).__name__)
                da.backward(cid, [_in_place_remote(t1, t2)])
                assert t1.grad is not None  # retain_grad: the gradient its hook returned
                out[execute] = {"t1": t1.grad.tolist(), "want": (20 * t1.detach()).tolist()}
    return out


def test_received_tensors_take_in_place_ops_and_hooks_as_pytorch_s_do() -> None:
    outs = _outs(_in_place)
    want = torch.tensor(_in_place_local(_W.clone().requires_grad_()), dtype=torch.float64)
    for execute in ("nodes", "waves"):
        assert outs[1][f"leaf_{execute}"] == (False, "RecvBackward")
        got = torch.tensor(outs[0][execute]["w"], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (execute, got, want)
        assert outs[1][execute]["t1"] == outs[1][execute]["want"], execute


def _in_place_rpc(rank: int, world: int, init: str) -> Any:
    """:func:`_in_place` through PyTorch's RPC distributed autograd: rank 1's part runs
    on the tensors RPC gave it."""
    import torch.distributed.autograd as rpc_autograd
    import torch.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=init, num_worker_threads=4)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    got = None
    if rank == 0:
        w = _W.clone().requires_grad_()
        with rpc_autograd.context() as cid:
            y = w * 3
            remote = rpc.rpc_sync("w1", _in_place_remote, args=(y, y * 2))
            y.mul_(5)
            rpc_autograd.backward(cid, [y.sum() + remote])
            got = rpc_autograd.get_gradients(cid)[w].tolist()
    rpc.shutdown()
    return got


def test_the_in_place_graph_gives_what_pytorch_s_rpc_gives(tmp_path: Any) -> None:
    """The reference above is PyTorch's RPC distributed autograd's answer too."""
    import torch.distributed.rpc as rpc

    if not rpc.is_available():
        pytest.skip("torch.distributed.rpc is not available in this build of torch")
    got = _outs(_in_place_rpc, args=(f"file://{tmp_path}/rpc",))[0]
    want = _in_place_local(_W.clone().requires_grad_())
    got_, want_ = (torch.tensor(v, dtype=torch.float64) for v in (got, want))
    assert torch.allclose(got_, want_, rtol=0, atol=1e-12)


def _hooked_sender(w: torch.Tensor, send: Any) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Rank 0's part of :func:`_sent_hooks` (``send`` passes ``y`` on): its root, ``y``,
    and what ``y``'s hook saw."""
    seen: list[Any] = []
    y = w * 3
    y.register_hook(lambda g: seen.append(g.tolist()) or g * 10)
    y.retain_grad()
    send(y)
    loss = (y * y).sum()
    loss.register_hook(lambda g: g * 2)  # a hook on a root
    return loss, y, seen


def _sent_hooks(rank: int, world: int) -> dict[str, Any]:
    """Hooks on a tensor rank 0 sends twice (and uses itself) and on its root, both
    engines."""
    out: dict[str, Any] = {}
    for execute, w in _each_engine():
        with da.context(timeout=20) as cid:
            if rank == 0:
                loss, y, seen = _hooked_sender(w, lambda y: [da.send(y, 1), da.send(y, 1)])
                da.backward(cid, [loss])
                assert y.grad is not None
                grad = da.get_gradients(cid)[w]
                out[execute] = (grad.tolist(), y.grad.tolist(), seen)
            else:
                t1, t2 = da.recv(0), da.recv(0)
                da.backward(cid, [(t1 * t2).sum()])
    return out


def test_hooks_on_sent_tensors_and_roots_run_once_on_the_summed_gradient() -> None:
    """As PyTorch's engine runs them: once, on the gradient summed from the local root and
    the peer, and what they return flows on (the node engine calls torch nodes itself,
    which runs no hook: xgrad runs those of the tensors it is given)."""
    out = _outs(_sent_hooks)[0]
    w = _W.clone().requires_grad_()
    loss, y, seen = _hooked_sender(w, lambda y: None)
    t1, t2 = y.clone(), y.clone()  # what rank 1 receives
    (loss + (t1 * t2).sum()).backward()
    assert w.grad is not None and y.grad is not None and len(seen) == 1
    for execute in ("nodes", "waves"):
        assert out[execute] == (w.grad.tolist(), y.grad.tolist(), seen), execute
