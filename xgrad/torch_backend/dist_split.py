"""A rank's matrix products: the gradient another rank waits for first, the weight's later.

A matrix product's backward node (``MmBackward0`` for ``a @ b``, ``AddmmBackward0`` for a
linear layer with a bias) computes the gradients of all its inputs in one call, a matrix
product each. When one input's gradient goes back to another rank (its edge leads to a
recv) and the others only accumulate into leaves (a layer's weight and bias), that rank
waits for the first product only, and the second one (as long again) sits on the pass's
critical path. So the node's function computes the first and returns the rest as a
:class:`xgrad.engine.Deferred`, which the engine computes once nothing else is ready, as
zero-bubble pipeline schedules split a backward into B (the input's gradient) and W (the
weights'). No work is added: each product is computed once.

The products are torch's own, as its ``mm_mat1_backward`` and ``mm_mat2_backward`` make
them (``grad @ mat2.T`` and ``mat1.T @ grad``, or their transposed forms for a
column-major operand), so the gradients are the same bits. Where torch would compute
them otherwise (a complex or non-strided tensor, an ``alpha`` or ``beta`` other than 1)
the node runs whole, as every other node does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from xgrad.engine import Deferred, NodeFunction

__all__ = ["SPLIT", "SPLITTABLE", "fit", "split_caller"]

#: whether a matrix product computes the gradient bound for a peer first (see above).
SPLIT = True

#: node type -> the saved name of the input behind each of its edges (``next_functions``).
_INPUTS: dict[str, tuple[str, ...]] = {
    "MmBackward0": ("self", "mat2"),
    "AddmmBackward0": ("bias", "mat1", "mat2"),
}
#: the node types split (by name, as the graph names its nodes).
SPLITTABLE = frozenset(_INPUTS)


def fit(g: torch.Tensor, want: Any) -> torch.Tensor:
    """Between nodes, as PyTorch's engine: summed to the input's shape, cast to its dtype."""
    if g.shape != want.shape:
        g = g.sum_to_size(want.shape)
    if g.dtype != want.dtype:
        g = g.to(want.dtype)
    return g


def _column_major(sizes: Sequence[Any], strides: Sequence[Any]) -> bool:
    return len(strides) == 2 and strides[0] == 1 and strides[1] == sizes[0]


def _plain(fn: Any, name: str) -> bool:
    """Whether ``fn``'s saved tensor ``name`` is held as it is, not packed by hooks (a
    non-reentrant checkpoint's: reading one recomputes the region, outside the pass's
    one recomputation, :mod:`.dist_release`); True where torch saves it otherwise."""
    try:
        data = getattr(getattr(fn, name, None), "data", None)
    except RuntimeError:  # freed by an earlier pass: reading it raises that, as before
        return True
    return data is None or isinstance(data, torch.Tensor)


def split_caller(
    fn: Any,
    keep: Sequence[int],
    wants: Sequence[Any],
    first: Sequence[bool],
    whole: NodeFunction,
) -> NodeFunction | None:
    """The node function of matrix-product node ``fn`` that computes the kept edges marked
    in ``first`` now and defers the others; None for a node it does not split.

    ``keep``: the ``next_functions`` index of each edge of the graph; ``wants``: the input
    metadata each edge leads to; ``whole``: the node's ordinary function, used where torch
    would compute the products otherwise.
    """
    names = _INPUTS.get(type(fn).__name__)
    if names is None or all(first) or not any(first):
        return None
    if len(fn.next_functions) != len(names) or getattr(fn, "_saved_alpha", 1) != 1:
        return None
    if getattr(fn, "_saved_beta", 1) != 1:
        return None
    mat1_name = "mat1" if "mat1" in names else "self"
    if not _plain(fn, f"_raw_saved_{mat1_name}") or not _plain(fn, "_raw_saved_mat2"):
        return None  # packed by hooks (a checkpoint's): reading them now would unpack them
    try:  # what a torch of another version may not save, or name so
        mat1_sizes = tuple(getattr(fn, f"_saved_{mat1_name}_sym_sizes"))
        mat1_strides = tuple(getattr(fn, f"_saved_{mat1_name}_sym_strides"))
        mat2_sizes = tuple(fn._saved_mat2_sym_sizes)
        mat2_strides = tuple(fn._saved_mat2_sym_strides)
        mat1 = getattr(fn, f"_saved_{mat1_name}")
        mat2 = fn._saved_mat2
    except (AttributeError, RuntimeError):
        return None
    # torch saves each operand only for the other's gradient (None otherwise)
    kept = {names[i] for i in keep}
    needed = ([mat2] if kept & {"self", "mat1"} else []) + ([mat1] if "mat2" in kept else [])
    if any(m is None or m.layout != torch.strided or m.is_complex() for m in needed):
        return None
    products = [
        _product(names[i], mat1, mat2, _column_major(mat1_sizes, mat1_strides),
                 _column_major(mat2_sizes, mat2_strides))
        for i in keep
    ]  # fmt: skip
    now = [j for j, f in enumerate(first) if f]
    later = [j for j, f in enumerate(first) if not f]

    def part(js: list[int], grad: torch.Tensor) -> list[Any]:
        return [fit(products[j](grad), wants[j]) for j in js]

    def run(inputs: list[Any]) -> list[Any]:
        grad = inputs[0]
        if grad.layout != torch.strided or grad.is_complex():
            return list(whole(inputs))
        out: list[Any] = [None] * len(keep)
        for j, g in zip(now, part(now, grad), strict=True):
            out[j] = g
        deferred = Deferred(lambda: part(later, grad))
        for j in later:
            out[j] = deferred
        return out

    return run


def _product(
    name: str, mat1: torch.Tensor, mat2: torch.Tensor, mat1_col: bool, mat2_col: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gradient of input ``name`` from the node's gradient, as torch makes it."""
    if name == "bias":  # beta is 1; summed to the bias's shape by ``fit``
        return lambda grad: grad
    if name == "mat2":
        if mat2_col:
            return lambda grad: grad.t().mm(mat1).t()
        mat1_t = mat1.t()
        return lambda grad: mat1_t.mm(grad)
    if mat1_col:
        return lambda grad: mat2.mm(grad.t()).t()
    mat2_t = mat2.t()
    return lambda grad: grad.mm(mat2_t)
