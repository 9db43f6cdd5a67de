"""Hooks on tensors and nodes xgrad is not given run in a distributed pass as in one process.

xgrad's node engine calls torch's nodes itself, which runs none of their hooks; before
:mod:`xgrad.torch_backend.dist_hooks`, a hook on an intermediate tensor was skipped and
the gradients came out wrong without a word. On two gloo ranks, with both engines,
against the same computation in one process (float64, 1e-12): a tensor hook and
``retain_grad`` on an activation that is never sent, a module's full backward hook, a
pre-hook on a Python Function's node, a Function that does not materialize gradients,
hooks on C++ nodes and on a leaf's accumulator, each hook run once (torch's engine in
waves would run them once per wave);
a hook that raises fails the pass on every rank, named, and the next context works;
torch's entry points are as before once the contexts closed.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from ranks import run_ranks

from xgrad.torch_backend import dist_hooks


class _Pair(torch.autograd.Function):
    """``(2x, 3x)``; its backward records whether the unused output's gradient was None."""

    got_none: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx: Any, ga: Any, gb: Any) -> torch.Tensor:
        _Pair.got_none.append(gb is None)
        return ga * 2 if gb is None else ga * 2 + gb * 3


def _first_half(x: torch.Tensor, lin: torch.nn.Linear, seen: dict[str, Any]) -> torch.Tensor:
    """Rank 0's part: what it sends rank 1, with every kind of hook on the way."""

    calls = seen.setdefault("calls", [])

    def module_hook(mod: Any, grad_in: Any, grad_out: Any) -> tuple[torch.Tensor]:
        calls.append("module")
        seen["grad_out"] = grad_out[0].tolist()
        return (grad_in[0] * 3,)

    lin.register_full_backward_hook(module_hook)
    m = torch.tanh(lin(x))
    # An activation never sent: only this hook sees it. It scales by how often it ran.
    m.register_hook(lambda g: calls.append("m") or g * 10 * calls.count("m"))
    m.retain_grad()
    seen["m"] = m
    a, _ = _Pair.apply(m)
    assert a.grad_fn is not None
    a.grad_fn.register_prehook(lambda go: (go[0] * 0.5, go[1]))
    return a


def _f64(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _loss(r: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    return (r * r * w1).sum()


def _make(rank_seed: int = 0) -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(rank_seed)
    lin = torch.nn.Linear(4, 4).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    return x, lin, w1


def _one_process() -> dict[str, Any]:
    x, lin, w1 = _make()
    seen: dict[str, Any] = {}
    _Pair.got_none.clear()
    _loss(_first_half(x, lin, seen), w1).backward()
    m = seen["m"]
    return {
        "x": x.grad.tolist(), "weight": lin.weight.grad.tolist(), "bias": lin.bias.grad.tolist(),
        "w1": w1.grad.tolist(), "m": m.grad.tolist(), "grad_out": seen["grad_out"],
        "none": list(_Pair.got_none), "calls": seen["calls"],
    }  # fmt: skip


def _ranks(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import dist_autograd as da

    before = (torch.Tensor.register_hook, "retain_grad" in torch.Tensor.__dict__)
    out: dict[str, Any] = {}
    for execute in ("nodes", "waves"):
        da.EXECUTE = execute
        x, lin, w1 = _make()
        seen: dict[str, Any] = {}
        _Pair.got_none.clear()
        with da.context(timeout=20) as cid:
            # x comes from rank 1, so the hooked nodes lead to a recv and to leaves (torch's
            # engine in waves runs them in a wave for each).
            if rank == 0:
                da.send(_first_half(da.recv(1), lin, seen), 1)
                da.backward(cid, [])
                g = da.get_gradients(cid)
                m = seen["m"]
                out[execute] = {
                    "weight": g[lin.weight].tolist(), "bias": g[lin.bias].tolist(),
                    "m": m.grad.tolist(), "grad_out": seen["grad_out"],
                    "none": list(_Pair.got_none), "calls": seen["calls"],
                }  # fmt: skip
            else:
                da.send(x, 0)
                da.backward(cid, [_loss(da.recv(0), w1)])
                g = da.get_gradients(cid)
                out[execute] = {"x": g[x].tolist(), "w1": g[w1].tolist()}
        # A hook that raises, on an activation of rank 1: every rank fails, named.
        try:
            with da.context(timeout=20) as cid:
                if rank == 0:
                    da.send(x * 2, 1)
                    da.backward(cid, [])
                else:
                    z = da.recv(0) * 2
                    z.register_hook(lambda g: 1 / 0)
                    da.backward(cid, [z.sum()])
            out[f"failure_{execute}"] = "no error"
        except da.DistBackwardError as exc:
            out[f"failure_{execute}"] = str(exc)
        with da.context(timeout=20) as cid:
            if rank == 0:
                da.send(x * 2, 1)
                da.backward(cid, [])
                out[f"after_{execute}"] = da.get_gradients(cid)[x].tolist()
            else:
                da.backward(cid, [da.recv(0).sum()])
    out["restored"] = (torch.Tensor.register_hook, "retain_grad" in torch.Tensor.__dict__) == before
    return out


def test_hooks_inside_the_graph_run_as_in_one_process_on_both_engines() -> None:
    results, codes = run_ranks(_ranks, 2, timeout=90)
    assert codes == {0: 0, 1: 0}, (codes, results)
    assert [results[r][0] for r in (0, 1)] == ["ok", "ok"], results
    got = [results[r][1] for r in (0, 1)]
    want = _one_process()
    assert want["none"] == [True]  # torch gives the Function None for the unused output
    for execute in ("nodes", "waves"):
        mine = {**got[0][execute], **got[1][execute]}
        assert mine["none"] == want["none"], execute
        assert mine["calls"] == want["calls"] == ["m", "module"], execute  # each hook once
        for key in ("x", "weight", "bias", "w1", "m", "grad_out"):
            diff = (_f64(mine[key]) - _f64(want[key])).abs().max()
            assert diff <= 1e-12, (execute, key, mine[key], want[key])
        for r in (0, 1):
            text = got[r][f"failure_{execute}"]
            assert text.startswith("Error on rank 1") and "ZeroDivisionError" in text, text
        assert got[0][f"after_{execute}"] == [[2.0] * 4] * 3
    assert got[0]["restored"] and got[1]["restored"]


def _cpp_part(r: torch.Tensor, w: torch.Tensor, calls: list[str]) -> torch.Tensor:
    """Rank 1's part of :func:`_cpp_nodes`: hooks on C++ nodes, a leaf's accumulator's too."""
    y = r * w
    assert y.grad_fn is not None
    y.grad_fn.register_prehook(lambda go: calls.append("pre") or (go[0] * 3,))
    z = y.sin()
    assert z.grad_fn is not None
    z.grad_fn.register_hook(lambda gi, go: calls.append("post") or (gi[0] * 5,))
    acc = (w * 1).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    acc.register_prehook(lambda go: calls.append("acc-pre") or (go[0] * 7,))
    acc.register_hook(lambda gi, go: calls.append(f"acc-post {len(gi)}") and None)
    return (z * 2).sum()


def _cpp_nodes(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend import dist_autograd as da

    out: dict[str, Any] = {}
    for execute in ("nodes", "waves"):
        da.EXECUTE = execute
        w = torch.arange(1.0, 4.0, dtype=torch.float64, requires_grad=True)
        calls: list[str] = []
        with da.context(timeout=20) as cid:
            if rank == 0:
                da.send(w * 10, 1)
                da.backward(cid, [])
            else:
                da.backward(cid, [_cpp_part(da.recv(0), w, calls)])
            out[execute] = [da.get_gradients(cid)[w].tolist(), calls]
    return out


def test_hooks_on_cpp_nodes_and_accumulators_run_once_as_in_one_process() -> None:
    results, codes = run_ranks(_cpp_nodes, 2, timeout=90)
    assert codes == {0: 0, 1: 0}, (codes, results)
    w0 = torch.arange(1.0, 4.0, dtype=torch.float64, requires_grad=True)
    w1 = w0.detach().clone().requires_grad_()
    calls: list[str] = []
    _cpp_part(w0 * 10, w1, calls).backward()
    assert calls == ["post", "pre", "acc-pre", "acc-post 0"]
    assert w0.grad is not None and w1.grad is not None
    for execute in ("nodes", "waves"):
        for r, leaf in ((0, w0), (1, w1)):
            grad = results[r][1][execute][0]
            assert leaf.grad is not None
            diff = (torch.tensor(grad, dtype=torch.float64) - leaf.grad).abs().max()
            assert diff <= 1e-12, (execute, r, grad, leaf.grad)
        assert results[1][1][execute][1] == calls, execute


def test_entry_points_are_replaced_only_while_a_context_is_open() -> None:
    originals = (torch.Tensor.register_hook, torch.autograd.function.FunctionCtx.__dict__)
    seen = dist_hooks.Seen()
    dist_hooks.begin(seen)
    try:
        assert torch.Tensor.register_hook is not originals[0]
        h = torch.ones(2, requires_grad=True) * 2
        h.register_hook(lambda g: g)
        assert list(seen.tensor_hooked.values()) == [h.grad_fn]
        assert seen.hooked_nodes() == [h.grad_fn, h.grad_fn]  # the node, the tensor's now
    finally:
        dist_hooks.end()
    assert torch.Tensor.register_hook is originals[0]
    assert "retain_grad" not in torch.Tensor.__dict__
    again = torch.ones(2, requires_grad=True) * 2
    again.register_hook(lambda g: g)  # recorded nowhere: no context is open
    assert len(seen.tensor_hooked) == 1


def test_a_hook_returning_the_wrong_number_of_gradients_is_named() -> None:
    def bad(go: Any) -> tuple[Any, ...]:
        return (go[0], go[0])

    try:
        dist_hooks.call_node_hooks({0: bad}, None, lambda g: g, [torch.ones(1)])
    except RuntimeError as exc:
        want = "hook 'bad' has returned an incorrect number of values (got 2, but expected 1)"
        assert want in str(exc)
    else:
        raise AssertionError("no error")


def _unneeded(rank: int, world: int) -> dict[str, Any]:
    """A hooked leaf sent (as is, and through a node) to a rank that does not use it."""
    from xgrad.torch_backend import dist_autograd as da

    out: dict[str, Any] = {}
    for execute in ("nodes", "waves"):
        da.EXECUTE = execute
        for through_node in (False, True):
            w = torch.ones(3, dtype=torch.float64, requires_grad=True)
            v = torch.ones(3, dtype=torch.float64, requires_grad=True)
            calls: list[Any] = []
            with da.context(timeout=20) as cid:
                if rank == 0:
                    w.register_hook(lambda g, seen=calls: seen.append(g) or g * 2)
                    da.send(torch.tanh(w) * 2 if through_node else w, 1)
                    da.backward(cid, [], accumulate_grad=True)
                else:
                    da.recv(0)  # received, its gradient not needed
                    da.backward(cid, [(v * 3).sum()], accumulate_grad=True)
                grads = da.get_gradients(cid)
            leaf = w if rank == 0 else v
            out[f"{execute} {through_node}"] = (len(grads), calls, leaf.grad is None)
    return out


def test_a_hooked_leaf_whose_gradient_no_rank_needs_gets_none_and_no_hook_call() -> None:
    # Torch calls no tensor hook when no gradient reaches the tensor; the engine gave the
    # hook None (a hook that used it failed the pass on every rank), and a leaf with a
    # hook came out of get_gradients with None.
    results, codes = run_ranks(_unneeded, 2, timeout=90)
    assert codes == {0: 0, 1: 0}, (codes, results)
    for case, (count, calls, no_grad) in results[0][1].items():
        assert (count, calls, no_grad) == (0, [], True), case
    for case, (count, calls, no_grad) in results[1][1].items():
        assert (count, calls, no_grad) == (1, [], False), case
