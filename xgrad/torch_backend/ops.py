"""The reducer's array operations on torch tensors (one instance serves every rank)."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Hashable, Sequence

import numpy as np
import torch

__all__ = ["TorchArrayOps", "dtypes_of", "first_other_dtype"]

#: from this many elements a gradient is scaled while copied (one pass) rather than
#: batched with others (a copy and a multiply: two passes, but one call for all).
_ONE_PASS_NUMEL = 1 << 14

#: a tensor's dtype, read without a Python frame (:func:`dtypes_of`).
_DTYPE = operator.attrgetter("dtype")


def dtypes_of(xs: Sequence[torch.Tensor]) -> list[torch.dtype]:
    """Every tensor's dtype, read in C (no Python frame per tensor: about 65 ns each, most
    of it torch's dtype getter), for the checks of a module converted behind the DDP's
    back, which run once per bucket or per forward pass."""
    return list(map(_DTYPE, xs))


def first_other_dtype(dtypes: list[torch.dtype], dtype: torch.dtype) -> int | None:
    """The index of the first of ``dtypes`` that is not ``dtype``; ``None`` when all are
    (counted in C; only a list that fails is searched)."""
    if dtypes.count(dtype) == len(dtypes):
        return None
    return next(k for k, other in enumerate(dtypes) if other is not dtype)


def _dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill ``x.numel()`` slots without gaps or overlap (in
    some order of its dimensions): PyTorch's ``is_non_overlapping_and_dense``."""
    if x.numel() == 0:
        return False
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _higher_order(grad: torch.Tensor) -> torch.Tensor:
    """A gradient that requires grad (``backward(create_graph=True)``), detached: reduced
    as any other, the graph behind it left local, with PyTorch's warning (its reducer
    does the same: the higher-order gradient is not synchronised)."""
    warnings.warn(_CREATE_GRAPH, UserWarning, stacklevel=2)
    return grad.detach()


#: PyTorch's words (``reducer.cpp``); warned once per place, as Python warnings are.
_CREATE_GRAPH = (
    "Using DistributedDataParallel with create_graph=True  is not well-supported. The "
    "higher-order gradient will  not be synchronized across ranks, and backpropagation  "
    "through all_reduce operations will not occur. If you require  DDP to work with "
    "higher-order gradients for your use case,  please ping "
    "https://github.com/pytorch/pytorch/issues/63929"
)


class TorchArrayOps:
    """``xgrad.reducer.ArrayOps`` for torch tensors, on any device.

    Copies write straight into the bucket views the reducer keeps (no intermediate
    tensor), and the pre-division multiplies while copying, as PyTorch's reducer does, so
    the averaged gradients match PyTorch's bit for bit.

    ``copy_to`` is the per-gradient hot path. Multiplying by a Python float wraps it in a
    new tensor on every call, so float32 and float64 reuse a 0-dim tensor holding the same
    value (other dtypes keep the Python float, to round exactly as PyTorch does).
    """

    def __init__(self, flat_dtype: torch.dtype | None = None) -> None:
        #: the buckets' dtype when it differs from the parameters' (mixed precision).
        self.flat_dtype = flat_dtype
        self._scales: dict[tuple[float, torch.dtype], torch.Tensor | float] = {}

    def numel(self, x: torch.Tensor) -> int:
        return x.numel()

    def nbytes(self, x: torch.Tensor) -> int:
        return x.numel() * x.element_size()

    def key(self, x: torch.Tensor) -> Hashable:
        return (x.dtype, x.device)

    def new_flat(self, like: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
        dtype = like[0].dtype if self.flat_dtype is None else self.flat_dtype
        return torch.zeros(numel, dtype=dtype, device=like[0].device)

    def copy_to(self, out: torch.Tensor, x: torch.Tensor, scale: float | None = None) -> None:
        if x.requires_grad:
            x = _higher_order(x)
        if scale is None:
            out.copy_(x)
            return
        factor = self._scales.get((scale, x.dtype))
        torch.mul(x, self._scale(scale, x.dtype) if factor is None else factor, out=out)

    def _scale(self, scale: float, dtype: torch.dtype) -> torch.Tensor | float:
        if dtype is not torch.float32 and dtype is not torch.float64:
            return scale
        found = self._scales[scale, dtype] = torch.tensor(scale, dtype=dtype)
        return found

    def copy_all(
        self, outs: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], scale: float | None
    ) -> None:
        if torch.is_grad_enabled() and any(x.requires_grad for x in xs):  # create_graph
            xs = [_higher_order(x) for x in xs]
        if scale is None:
            torch._foreach_copy_(list(outs), list(xs))
            return
        # Small gradients: two fused calls for all of them (copying, then multiplying in
        # place by the same scalar, rounds exactly as multiplying while copying does).
        # Large ones: one multiply-while-copying pass each, as PyTorch's reducer does,
        # since a second pass over memory would cost more than the call saved.
        small_out: list[torch.Tensor] = []
        small_x: list[torch.Tensor] = []
        for out, x in zip(outs, xs, strict=True):
            if out.numel() >= _ONE_PASS_NUMEL:
                self.copy_to(out, x, scale)
            else:
                small_out.append(out)
                small_x.append(x)
        if not small_out:
            return
        dtype = small_out[0].dtype
        factor = self._scales.get((scale, dtype))
        if factor is None:
            factor = self._scale(scale, dtype)
        if not isinstance(factor, torch.Tensor) or any(o.dtype is not dtype for o in small_out):
            # Half precision: a fused multiply by a float rounds the factor to the
            # tensors' dtype first, PyTorch's reducer does not; one multiply each.
            for out, x in zip(small_out, small_x, strict=True):
                self.copy_to(out, x, scale)
            return
        torch._foreach_copy_(small_out, small_x)
        # The cached 0-dim factor (as in copy_to): a Python float costs three times as
        # much per call (12 vs 4 µs for 7 small tensors), for the same products.
        torch._foreach_mul_(small_out, factor)

    def view(self, flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
        """``like``'s place in ``flat``, laid out with ``like``'s strides when it is dense
        (channels_last, a transposed weight), as PyTorch's reducer lays its bucket views:
        the buffer then holds the gradient in memory order, which decides the order gloo
        sums each element in (and ``gradient_as_bucket_view`` keeps the layout)."""
        if like.is_contiguous() or not flat.is_contiguous() or not _dense(like):
            return flat.narrow(0, offset, like.numel()).view(like.shape)
        return flat.as_strided(like.shape, like.stride(), flat.storage_offset() + offset)

    def div_(self, x: torch.Tensor, divisor: int) -> None:
        x.div_(divisor)

    def clone(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def div_all(self, xs: Sequence[torch.Tensor], divisor: int) -> None:
        torch._foreach_div_(list(xs), divisor)

    def zero_(self, x: torch.Tensor) -> None:
        x.zero_()

    def is_view_of(self, x: torch.Tensor, view: torch.Tensor) -> bool:
        return (
            x.data_ptr() == view.data_ptr()
            and x.shape == view.shape
            and x.stride() == view.stride()
            and x.dtype == view.dtype
        )

    def dtype_mismatch(
        self, flat: torch.Tensor, xs: Sequence[torch.Tensor]
    ) -> tuple[int, str, str] | None:
        if not xs:
            return None
        dtypes = dtypes_of(xs)
        k = first_other_dtype(dtypes, flat.dtype)
        return None if k is None else (k, str(dtypes[k]), str(flat.dtype))

    def from_numpy(self, a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(like.device)

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().cpu().numpy()
