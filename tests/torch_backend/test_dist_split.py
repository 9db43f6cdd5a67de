"""Matrix products compute the gradient bound for a peer first and defer the weights'.

The split node's gradients must be torch's own, bit for bit, for every operand layout
torch treats apart (a column-major operand), and a node torch computes otherwise (alpha,
complex) is left whole. Across three gloo ranks, linear layers fed by a peer must give
the one-process gradients, with the split taking place.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from ranks import run_ranks

from xgrad.engine import Deferred
from xgrad.torch_backend import dist_split
from xgrad.torch_backend.dist_split import split_caller


def _node_and_grad(kind: str, layout: str, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    a = torch.randn(5, 4, generator=g, dtype=dtype)
    w = torch.randn(6, 4, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(6, generator=g, dtype=dtype).requires_grad_()
    if layout == "a column-major":
        a = a.t().contiguous().t()
    a.requires_grad_()
    if kind == "mm":
        # w.t() is column-major: the mat2 gradient's transposed form
        mat2 = w.t() if layout != "b row-major" else w.t().contiguous().detach().requires_grad_()
        out = a @ mat2
    else:
        out = F.linear(a, w, b)
    return out.grad_fn, torch.randn(out.shape, generator=g, dtype=dtype)


def _edges(fn: Any) -> tuple[list[int], list[Any]]:
    keep = [i for i, (c, _) in enumerate(fn.next_functions) if c is not None]
    wants = [fn.next_functions[i][0]._input_metadata[fn.next_functions[i][1]] for i in keep]
    return keep, wants


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["row-major", "a column-major", "b row-major"])
@pytest.mark.parametrize("kind", ["mm", "addmm"])
def test_split_gradients_are_torchs_own_bit_for_bit(kind: str, layout: str, dtype: Any) -> None:
    fn, grad = _node_and_grad(kind, layout, dtype)
    assert type(fn).__name__ == ("MmBackward0" if kind == "mm" else "AddmmBackward0")
    expected = [g for g in fn(grad) if g is not None]
    keep, wants = _edges(fn)
    # every choice of what goes first: the input's (B) gradient, or the weight's
    for first_at in range(len(keep)):
        first = [j == first_at for j in range(len(keep))]
        split = split_caller(fn, keep, wants, first, lambda g: pytest.fail("ran whole"))
        assert split is not None
        out = split([grad])
        assert [type(o) is Deferred for o in out] == [not f for f in first]
        parts = [o for o in out if type(o) is Deferred]
        assert all(p is parts[0] for p in parts)  # one deferred part for the rest
        later = iter(parts[0].compute())
        got = [o if type(o) is not Deferred else next(later) for o in out]
        for g, want in zip(got, expected, strict=True):
            if g.shape != want.shape:  # the bias: the engine's sum to its shape
                want = want.sum_to_size(g.shape)
            assert torch.equal(g, want), (kind, layout, first_at)


def test_a_frozen_weight_leaves_the_bias_deferred_and_the_input_exact() -> None:
    """``F.linear`` with a weight that needs no gradient: torch saves no ``mat1`` (only the
    weight's gradient would use it); the input's gradient goes first, the bias's later."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, generator=g).requires_grad_()
    w = torch.randn(5, 3, generator=g)
    b = torch.randn(5, generator=g).requires_grad_()
    fn = F.linear(x, w, b).grad_fn
    assert fn._saved_mat1 is None
    keep, wants = _edges(fn)
    split = split_caller(fn, keep, wants, [False, True], lambda g: pytest.fail("ran whole"))
    assert split is not None
    grad = torch.randn(4, 5, generator=g)
    bias_later, x_now = split([grad])
    assert type(bias_later) is Deferred
    expected = fn(grad)
    assert torch.equal(x_now, expected[1])
    assert torch.equal(bias_later.compute()[0], expected[0].sum_to_size(5))


def test_nodes_torch_computes_otherwise_are_not_split() -> None:
    a = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 2, requires_grad=True)
    b = torch.randn(2, requires_grad=True)
    scaled = torch.addmm(b, a, w, alpha=2.0).grad_fn  # alpha: not split
    complex_mm = (a.to(torch.complex64) @ w.to(torch.complex64)).grad_fn.next_functions
    plain = (a @ w).grad_fn
    for fn in (scaled, plain):
        keep, wants = _edges(fn)
        everything = [True] * len(keep)
        assert split_caller(fn, keep, wants, everything, lambda g: g) is None  # nothing later
    keep, wants = _edges(scaled)
    assert split_caller(scaled, keep, wants, [False, True, False], lambda g: g) is None
    mm_c = (a.to(torch.complex64) @ w.to(torch.complex64)).grad_fn
    assert type(mm_c).__name__ == "MmBackward0" and complex_mm
    keep, wants = _edges(mm_c)
    assert split_caller(mm_c, keep, wants, [True, False], lambda g: g) is None
    tanh = torch.tanh(a).grad_fn  # not a matrix product
    assert split_caller(tanh, [0], _edges(tanh)[1], [True], lambda g: g) is None


def _layers(rank: int, world: int) -> dict[str, Any]:
    """A chain of layers: rank 0 -> linear on rank 1 -> matmul by a transposed weight on
    rank 2 -> back to rank 0; every leaf's gradient against one process's (float64)."""
    from xgrad.torch_backend import dist_autograd as da

    made: list[str] = []
    real = dist_split.split_caller

    def counted(fn: Any, *args: Any) -> Any:
        split = real(fn, *args)
        if split is not None:
            made.append(type(fn).__name__)
        return split

    dist_split.split_caller = counted  # type: ignore[assignment]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)
    P = {k: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
         for k, s in (("W0", (4, 4)), ("W1", (3, 4)), ("b1", (3,)), ("W2", (2, 3)),
                      ("u", (5, 2)))}  # fmt: skip

    def reference() -> torch.Tensor:
        h = torch.tanh(x @ P["W0"])
        h = torch.tanh(F.linear(h, P["W1"], P["b1"]))
        return ((h @ P["W2"].t()) * P["u"]).sum()

    mine = {0: ("W0", "u"), 1: ("W1", "b1"), 2: ("W2",)}[rank]
    expected = torch.autograd.grad(reference(), [P[k] for k in mine])

    def one_pass(**context: Any) -> float:
        """This rank's part; the largest difference from the one-process gradients."""
        with da.context(**context) as cid:
            roots = []
            if rank == 0:
                da.send(torch.tanh(x @ P["W0"]), 1)
                roots = [(da.recv(2) * P["u"]).sum()]
            elif rank == 1:
                da.send(torch.tanh(F.linear(da.recv(0), P["W1"], P["b1"])), 2)
            else:
                da.send(da.recv(1) @ P["W2"].t(), 0)
            da.backward(cid, roots)
            got = da.get_gradients(cid)
            pairs = zip(mine, expected, strict=True)
            return max(float((got[P[k]] - e).abs().max()) for k, e in pairs)

    # The same graph again and again: the split is made for each pass's nodes.
    worst = [one_pass() for _ in range(3)]
    # A hook on rank 1's weight fails: its gradient is a deferred part's; every rank
    # raises naming rank 1's accumulator, and the next pass is exact again.
    failed = ""
    if rank == 1:
        P["W1"].register_hook(lambda g: 1 / 0)
    try:
        one_pass(timeout=20)
    except da.DistBackwardError as exc:
        failed = str(exc)
    P["W1"] = P["W1"].detach().requires_grad_()  # the same values, without the hook
    worst.append(one_pass())
    return {"worst": worst, "split": made, "failed": failed}


def test_linear_layers_fed_by_a_peer_split_and_give_one_process_gradients() -> None:
    results, codes = run_ranks(_layers, 3, timeout=120)
    assert all(code == 0 for code in codes.values()), (codes, results)
    for rank in range(3):
        status, out = results[rank]
        assert status == "ok", out
        assert max(out["worst"]) < 1e-12, (rank, out)
    # rank 0's product has no gradient for a peer (x is data): whole; 1 and 2 split
    assert results[0][1]["split"] == []
    assert results[1][1]["split"] == ["AddmmBackward0"] * 5
    assert results[2][1]["split"] == ["MmBackward0"] * 5
    for rank in range(3):
        assert results[rank][1]["failed"].startswith(
            "Error on rank 1 in AccumulateGrad: ZeroDivisionError"
        ), results[rank][1]["failed"]
