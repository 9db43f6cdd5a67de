"""The reducer's side of the DDP's gradient hooks: reduced gradients written back, views lent.

Kept apart from the hooks themselves (:mod:`.ddp_hooks`, whose class mixes this in): the
hooks feed the reducer as gradients arrive, this is what the reducer calls back with at
the end of the pass (``set_grad``, ``set_grads``) and as the
:class:`~xgrad.reducer_types.Lender` of bucket views (``lend``, ``lend_many``, ``free``).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import torch
from torch import nn

from xgrad.reducer import Reducer
from xgrad.torch_backend.ddp_lend import lend_sole, sole_grad, views_free

__all__ = ["GradientWriteBack"]


class GradientWriteBack:
    """Mixed into :class:`~xgrad.torch_backend.ddp_hooks.GradientHooks`; uses its state."""

    params: list[nn.Parameter]
    gradient_as_bucket_view: bool
    reducer: Reducer | None
    _copy_dst: list[torch.Tensor]
    _copy_src: list[torch.Tensor]

    def lend(self, index: int, view: torch.Tensor) -> bool:
        """Make ``view`` the gradient when the old one is seen by its parameter only."""
        p = self.params[index]
        if not sole_grad(p):
            return False
        p.grad = view
        return True

    def lend_many(self, indices: Sequence[int], views: Sequence[torch.Tensor]) -> list[bool]:
        """:meth:`lend` for several parameters in one call (see :func:`.ddp_lend.lend_sole`)."""
        return lend_sole(self.params, indices, views)

    def free(self, flat: torch.Tensor, views: Sequence[torch.Tensor], lent: Sequence[int]) -> bool:
        """Whether every lent view of ``flat`` came back (see :func:`.ddp_lend.views_free`)."""
        return views_free(flat, views, lent)

    def set_grad(self, index: int, view: torch.Tensor) -> None:
        """The reducer's write-back of parameter ``index``'s reduced gradient."""
        p = self.params[index]
        grad = p.grad
        if view.layout is not torch.strided:
            # A sparse bucket: the reduced tensor replaces the gradient (PyTorch copies
            # the result into the gradient tensor, which comes to the same values); under
            # mixed precision it is upcast, as the dense gradients are, to the parameter's
            # dtype (assigning a param_dtype gradient to a full-precision one raised).
            p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
            return
        # Under mixed precision the buckets hold param_dtype: the gradient cannot be their
        # view, so it is a full-precision copy (as PyTorch's, gradient_as_bucket_view or not).
        if self.gradient_as_bucket_view and view.dtype == p.dtype:
            if grad is None or grad.data_ptr() != view.data_ptr():
                p.grad = view
        elif grad is None:
            p.grad = view.to(p.dtype, copy=True)
        else:
            self._copy_dst.append(grad)
            self._copy_src.append(view)

    def point_grads(self, indices: Sequence[int], views: Sequence[torch.Tensor]) -> None:
        """Under ``gradient_as_bucket_view``, once a bucket's gradients are copied in: make
        the copied ones their bucket views before the bucket's hook runs, as PyTorch's
        reducer does as it marks each ready, so a hook reading ``p.grad`` sees the views
        from the first pass on (the reducer's ``point_grads``; not under mixed precision,
        whose buckets hold another dtype)."""
        params = self.params
        for i, view in zip(indices, views, strict=True):
            params[i].grad = view

    def set_grads(self, indices: Sequence[int], views: Sequence[torch.Tensor]) -> None:
        """:meth:`set_grad` for a bucket's members: one list operation when all are copies."""
        params = self.params
        grads = [params[i].grad for i in indices]
        if (
            self.gradient_as_bucket_view
            or views[0].layout is not torch.strided
            or any(map(operator.is_, grads, itertools.repeat(None)))
        ):
            for i, view in zip(indices, views, strict=True):
                self.set_grad(i, view)
            return
        self._copy_dst += grads  # type: ignore[arg-type]
        self._copy_src += views

    def alias_grads_to_buckets(self) -> None:
        """Make existing gradients views into the (new) buckets, keeping their values."""
        assert self.reducer is not None
        with torch.no_grad():
            for p, view in zip(self.params, self.reducer.bucket_views(), strict=True):
                if view is None or view.dtype != p.dtype:
                    continue  # a sparse gradient has no bucket view; mixed precision's differ
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
