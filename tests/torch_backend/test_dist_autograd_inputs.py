"""Distributed autograd on inputs a new user sends, on real gloo groups.

- A received tensor of one element summed into the loss: its gradient is ``sum()``'s
  expanded one, "contiguous" with stride 0, and still goes back (it once failed the send).
- What ``send`` sends is the tensor as it was at the call, as PyTorch's RPC serialises it:
  the sender writing into it afterwards changes nothing the receiver sees.
- A sparse tensor is refused at the ``send`` call with a ``TypeError`` (not taken for a
  lost peer, which left the receiver waiting for the timeout), and the others hear of it.
- A rank outside the context's group is refused at ``context()``.
- A transfer that fails after another rank already posted a failure raises the context's
  ``DistBackwardError`` (it once raised the bare ``RankError`` of the failure channel).
- A group whose connections a timed-out receive closed is said to be lost at the next
  context (it blamed rank 0 with gloo's "Connection closed by peer" alone).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from ranks import run_ranks

FAST_HEARTBEAT = {"XGRAD_HEARTBEAT_INTERVAL": "0.1", "XGRAD_HEARTBEAT_TIMEOUT": "2"}


def _inputs(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from xgrad.torch_backend import dist_autograd as da

    out: dict[str, Any] = {}
    for shape in ((1,), (1, 1), (), (0,), (2, 0)):  # (0,): sum()'s gradient has stride 0 too
        w = torch.full(shape, 3.0, dtype=torch.float64, requires_grad=True)
        with da.context(timeout=20) as cid:
            if rank == 0:
                da.send(w * 2, 1)
                da.backward(cid, [])
                out[f"grad{shape}"] = da.get_gradients(cid)[w].tolist()
            else:
                da.backward(cid, [da.recv(0).sum()])

    with da.context(timeout=20) as cid:
        if rank == 0:
            t = torch.ones(10)
            da.send(t, 1)
            t.fill_(7.0)  # after the call: not what rank 1 receives
            big = torch.ones(100_000)
            da.send(big, 1)
            big.fill_(7.0)
        else:
            out["snapshot"] = sorted(set(da.recv(0).tolist() + da.recv(0).tolist()))
        da.backward(cid, [])

    start = time.monotonic()
    try:
        with da.context(timeout=20) as cid:
            if rank == 0:
                da.send(torch.eye(3).to_sparse(), 1)
            else:
                da.recv(0)
            da.backward(cid, [])
        out["sparse"] = "no error"
    except (TypeError, da.DistBackwardError) as exc:
        out["sparse"] = f"{type(exc).__name__}: {exc}"
    out["sparse_took"] = time.monotonic() - start

    with da.context(timeout=20) as cid:  # the group still works
        if rank == 0:
            da.send(torch.ones(2, requires_grad=True) * 5, 1)
        else:
            out["after"] = da.recv(0).tolist()
        da.backward(cid, [])

    others = dist.new_group([1])
    try:
        with da.context(group=others):
            pass
        out["nonmember"] = "no error"
    except ValueError as exc:
        out["nonmember"] = str(exc)
    return out


def test_one_element_gradients_snapshots_sparse_tensors_and_groups() -> None:
    results, codes = run_ranks(_inputs, 2, timeout=120)
    assert all(code == 0 for code in codes.values()), (codes, results)
    out = [results[r][1] for r in range(2)]
    for shape in ((1,), (1, 1), ()):
        want = 2.0 if shape == () else [[2.0]] if len(shape) == 2 else [2.0]
        assert out[0][f"grad{shape}"] == want, shape
    assert out[0]["grad(0,)"] == [] and out[0]["grad(2, 0)"] == [[], []]
    assert out[1]["snapshot"] == [1.0]
    assert out[0]["sparse"].startswith("TypeError: send: a torch.sparse_coo tensor cannot be sent")
    assert out[1]["sparse"].startswith("DistBackwardError: Error on rank 0 in forward: TypeError")
    assert out[1]["sparse_took"] < 10.0  # not the context's 20 s timeout
    assert out[1]["after"] == [5.0, 5.0]
    assert out[0]["nonmember"].startswith("group: rank 0 is not a member of this process group")


def _late_send(rank: int, world: int) -> tuple[bool, str, str, float]:
    """Rank 2 dies; rank 0, waiting on it, posts that; then rank 1's send to it fails."""
    import torch

    from xgrad.torch_backend import dist_autograd as da

    os.environ.update(FAST_HEARTBEAT)
    start = time.monotonic()
    try:
        with da.context(timeout=30) as cid:
            if rank == 2:
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 0:
                da.recv(2)
            if rank == 1:
                time.sleep(4.0)  # the failure is posted by now
                da.send(torch.ones(1000), 2)
            da.backward(cid, [])
    except Exception as exc:
        ours = isinstance(exc, da.DistBackwardError)
        return ours, type(exc).__name__, str(exc), time.monotonic() - start
    return False, "no error", "", time.monotonic() - start


def test_a_transfer_failing_after_a_posted_failure_raises_the_contexts_error() -> None:
    results, codes = run_ranks(_late_send, 3, timeout=90, frozen=[2])
    for rank in (0, 1):
        status, (ours, name, text, took) = results[rank]
        assert status == "ok"
        assert ours, (rank, name, text)  # DistBackwardError or its Unresponsive subclass
        assert text.startswith("Error on rank 2: stopped answering"), text
        assert took < 4.0 + 10.0
        assert codes[rank] == 0


def _after_a_timeout(rank: int, world: int) -> list[str]:
    """Rank 0 sends 2.5 s late into a context with a 1 s timeout; the receive that runs out
    closes gloo's connections, and the next context says so instead of blaming rank 0."""
    import torch

    from xgrad.torch_backend import dist_autograd as da

    out = []
    for late, timeout in ((2.5, 1.0), (0.0, 10.0)):
        try:
            with da.context(timeout=timeout) as cid:
                if rank == 0:
                    time.sleep(late)
                    da.send(torch.ones(2, requires_grad=True) * 2, 1)
                got = da.recv(0) if rank == 1 else None
                da.backward(cid, [got.sum()] if got is not None else [])
            out.append("no error")
        except da.DistBackwardError as exc:
            out.append(str(exc))
    return out


def test_a_group_lost_to_a_timeout_is_said_to_be_lost() -> None:
    results, codes = run_ranks(_after_a_timeout, 3, timeout=90)
    assert all(code == 0 for code in codes.values()), (codes, results)
    for rank in range(3):
        first, second = results[rank][1]
        assert "timed out after 1 s" in first, (rank, first)
        assert "the group's connection was closed earlier" in second, (rank, second)


def _interrupted(rank: int, world: int) -> dict[str, Any]:
    """Ctrl-C inside rank 1's backward (a node raising KeyboardInterrupt): rank 1 gets it as
    it is, the others a DistBackwardError naming the node at once, and the next context
    works (it once left the group broken and rank 0 waiting out the timeout)."""
    import torch

    from xgrad.torch_backend import dist_autograd as da

    class Interrupt(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 1

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            raise KeyboardInterrupt(f"interrupted on rank {rank}")

    out: dict[str, Any] = {}
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    for attempt, fail in (("first", True), ("next", False)):
        start = time.monotonic()
        try:
            with da.context(timeout=20) as cid:
                if rank == 0:
                    da.send(w * 2, 1)
                    da.backward(cid, [])
                    out[f"{attempt}_grad"] = da.get_gradients(cid)[w].tolist()
                elif rank == 1:
                    got = da.recv(0)
                    y = Interrupt.apply(got) if fail else got
                    da.send(y * 3, 2)
                    da.backward(cid, [])
                else:
                    da.backward(cid, [da.recv(1).sum()])
            out[attempt] = "no error"
        except BaseException as exc:  # KeyboardInterrupt on rank 1
            out[attempt] = f"{type(exc).__name__}: {exc}"
        out[f"{attempt}_took"] = time.monotonic() - start
    return out


def test_a_keyboard_interrupt_in_backward_reaches_every_rank_and_the_group_stays() -> None:
    results, codes = run_ranks(_interrupted, 3, timeout=90)
    assert all(code == 0 for code in codes.values()), (codes, results)
    out = [results[r][1] for r in range(3)]
    assert out[1]["first"] == "KeyboardInterrupt: interrupted on rank 1"
    for rank in (0, 2):
        assert out[rank]["first"].startswith(
            "DistBackwardError: Error on rank 1 in InterruptBackward: KeyboardInterrupt"
        ), out[rank]["first"]
        assert out[rank]["first_took"] < 5.0, out[rank]
    assert all(o["next"] == "no error" for o in out), out
    assert out[0]["next_grad"] == [6.0, 6.0, 6.0]


def _accumulation(rank: int, world: int) -> dict[str, Any]:
    """Two passes in one context, and ``accumulate_grad`` over two contexts, with a
    leaf whose layout is not contiguous (a transposed parameter)."""
    import torch

    from xgrad.torch_backend import dist_autograd as da

    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64).t()
    w.requires_grad_()  # strides (1, 3): a leaf laid out as its transpose
    out: dict[str, Any] = {}
    with da.context(timeout=20) as cid:
        if rank == 0:
            da.send(w * 2, 1)
            da.backward(cid, [], retain_graph=True)
            first = da.get_gradients(cid)[w]
            da.backward(cid, [])
            out["first_after_second"] = first.tolist()
            out["second"] = da.get_gradients(cid)[w].tolist()
        else:
            y = da.recv(0)
            da.backward(cid, [y.sum()], retain_graph=True)
            da.backward(cid, [y.sum()])
    grads = []
    for _ in range(2):
        with da.context(timeout=20) as cid:
            if rank == 0:
                da.send(w * 2, 1)
                da.backward(cid, [], accumulate_grad=True)
                assert w.grad is not None
                grads.append((w.grad.data_ptr(), w.grad.stride(), w.grad.tolist()))
            else:
                da.backward(cid, [da.recv(0).sum()], accumulate_grad=True)
    out["grads"] = grads
    return out


def test_gradients_accumulate_in_place_as_pytorchs_do() -> None:
    """A dict ``get_gradients`` returned missed a later pass of the same context (a new
    tensor each time), and ``accumulate_grad`` made a new, contiguous ``.grad`` each
    time; PyTorch's context and AccumulateGrad add in place, in the leaf's layout."""
    results, codes = run_ranks(_accumulation, 2, timeout=120)
    assert all(code == 0 for code in codes.values()), (codes, results)
    out = results[0][1]
    assert out["first_after_second"] == out["second"] == [[4.0] * 2] * 3
    (ptr1, stride1, grad1), (ptr2, stride2, grad2) = out["grads"]
    assert ptr1 == ptr2 and stride1 == stride2 == (1, 3)
    assert grad1 == [[2.0] * 2] * 3 and grad2 == [[4.0] * 2] * 3
