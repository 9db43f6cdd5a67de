"""Lending bucket views out as gradients: PyTorch's copy back, without the copy.

After the reduction PyTorch's reducer copies each averaged bucket view into the
parameter's ``.grad`` (unless ``gradient_as_bucket_view``): one more pass over every
gradient byte, the largest cost DDP adds to a step of a model with large tensors. When
the gradient the pass produced is seen by nothing but its parameter (the usual case
with ``zero_grad()``, which sets gradients to ``None``: autograd made a fresh tensor in
this pass), the bucket view can *become* ``.grad`` instead: the same values, bit for bit,
and no one can tell the tensor was swapped. Otherwise (a gradient held elsewhere, a view
of another buffer, the user's own tensor) it is copied into, as PyTorch does.

A lent view is the reducer's buffer, so before the bucket is filled again the reducer
asks whether every lent view came back (no ``.grad`` and no one else holds it, nor any
view of the buffer); if not, the bucket gets a fresh buffer and the holders keep theirs.
So ``zero_grad(set_to_none=False)``, a kept ``g = p.grad`` or a failed pass see exactly
what PyTorch's DDP would show them.

"Seen by nothing else" is counted, not guessed: the tensor's C++ references, its storage's
references and its Python references, each against a count taken (once, at the first
use) from a tensor known to be held only as a parameter's gradient.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

__all__ = ["lend_sole", "lendable", "sole_grad", "views_free"]

#: from this many elements a gradient is lent rather than copied back (below, the fused
#: copy of a bucket's small gradients costs less than swapping them one by one).
LEND_NUMEL = 1 << 14


def _storage_uses(t: torch.Tensor) -> int:
    """References to ``t``'s storage (the storage object made here counts one)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def _grad_counts(g: torch.Tensor) -> tuple[int, int, int]:
    """(Python, tensor, storage) references of ``g``, the caller holding it in a local."""
    return sys.getrefcount(g), g._use_count(), _storage_uses(g)  # type: ignore[attr-defined]


def _view_counts(views: Sequence[torch.Tensor], k: int) -> tuple[int, int]:
    """(Python, tensor) references of ``views[k]`` (the list and this frame hold it)."""
    v = views[k]
    return sys.getrefcount(v), v._use_count()  # type: ignore[attr-defined]


def _fresh_grad_param() -> torch.nn.Parameter:
    """A parameter whose gradient autograd made and only the parameter holds: the
    reference against which holder counts are calibrated."""
    with torch.inference_mode(False), torch.enable_grad():  # whatever the caller's mode
        param = torch.nn.Parameter(torch.zeros(2))
        (param * 2).sum().backward()
    return param


def _calibrate() -> tuple[tuple[int, int, int], tuple[int, int]]:
    """The counts of a gradient held by its parameter only, and of a view held by a list."""
    param = _fresh_grad_param()
    g = param.grad
    assert g is not None
    grad_counts = _grad_counts(g)
    del g
    views = [torch.zeros(4)[:2]]
    return grad_counts, _view_counts(views, 0)


_counts: list[tuple[tuple[int, int, int], tuple[int, int]]] = []


def _baseline() -> tuple[tuple[int, int, int], tuple[int, int]]:
    """:func:`_calibrate`'s counts, taken at the first use (not at import)."""
    if not _counts:
        _counts.append(_calibrate())
    return _counts[0]


def lendable(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient may be a bucket view (large, dense, laid out as one)."""
    return param.layout is torch.strided and param.is_contiguous() and param.numel() >= LEND_NUMEL


def sole_grad(param: torch.Tensor) -> bool:
    """Whether ``param.grad`` is seen by nothing but ``param`` (swapping it is invisible)."""
    g = param.grad
    if g is None:
        return True
    if g._is_view():
        return False
    return _grad_counts(g) == _baseline()[0]


def _lend_loop(
    params: Sequence[torch.Tensor],
    indices: Sequence[int],
    views: Sequence[torch.Tensor],
    sole: tuple[int, int, int] | None,
    seen: list[tuple[int, int, int]],
) -> list[bool]:
    """:func:`lend_sole`'s loop; with ``sole`` None it only records each gradient's counts
    (the calibration: the counts depend on this frame, so they are taken in it)."""
    uses = torch._C._storage_Use_Count
    getrefcount = sys.getrefcount
    lent = []
    for i, view in zip(indices, views, strict=True):
        p = params[i]
        g = p.grad
        if g is not None:
            counts = (getrefcount(g), g._use_count(), uses(g.untyped_storage()._cdata))  # type: ignore[attr-defined]
            if sole is None:
                seen.append(counts)
                continue
            if g._is_view() or counts != sole:
                lent.append(False)
                continue
        p.grad = view
        lent.append(True)
    return lent


_loop_counts: list[tuple[int, int, int]] = []


def lend_sole(
    params: Sequence[torch.Tensor],
    indices: Sequence[int],
    views: Sequence[torch.Tensor],
) -> list[bool]:
    """Per ``indices[k]``: make ``views[k]`` the gradient where :func:`sole_grad` holds.

    One loop instead of a call per parameter (this runs after the last bucket's wait,
    on the step's critical path); the same test, with the counts taken in the loop.
    """
    if not _loop_counts:
        param = _fresh_grad_param()
        _lend_loop([param], [0], [param], None, _loop_counts)
    return _lend_loop(params, indices, views, _loop_counts[0], [])


def views_free(flat: torch.Tensor, views: Sequence[torch.Tensor], lent: Sequence[int]) -> bool:
    """Whether no one but the reducer holds ``flat``'s storage or the ``lent`` views.

    ``views`` are the bucket's views of ``flat`` (one tensor each); a ``.grad`` still set
    to a lent view, a kept reference to one, or any other view of the buffer makes it
    not free.
    """
    if _storage_uses(flat) != len(views) + 2:  # the flat, its views, the storage object
        return False
    free = _baseline()[1]
    return all(_view_counts(views, k) == free for k in lent)
