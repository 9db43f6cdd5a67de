"""The reducer's array operations for NumPy arrays (the core's own array type)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np


class NumpyOps:
    """:class:`xgrad.reducer.ArrayOps` for ``numpy.ndarray``.

    Scaling multiplies by ``scale`` cast to the buffer's dtype, the same arithmetic as
    PyTorch's reducer (``mul_out`` by a wrapped ``1/world_size`` scalar), so numpy ranks
    and torch ranks produce the same bits for the same inputs.
    """

    def numel(self, x: Any) -> int:
        return int(np.size(x))

    def nbytes(self, x: Any) -> int:
        return int(np.asarray(x).nbytes)

    def key(self, x: Any) -> Hashable:
        return ("numpy", np.asarray(x).dtype.str)

    def new_flat(self, like: Sequence[Any], numel: int) -> np.ndarray:
        return np.zeros(numel, dtype=np.asarray(like[0]).dtype)

    def copy_to(self, out: np.ndarray, x: Any, scale: float | None = None) -> None:
        src = np.asarray(x).reshape(out.shape)
        if scale is None:
            out[...] = src
        else:
            np.multiply(src, out.dtype.type(scale), out=out)

    def copy_all(self, outs: Sequence[np.ndarray], xs: Sequence[Any], scale: float | None) -> None:
        for out, x in zip(outs, xs, strict=True):
            self.copy_to(out, x, scale)

    def view(self, flat: np.ndarray, offset: int, like: Any) -> np.ndarray:
        shape = np.shape(like)
        return flat[offset : offset + int(np.prod(shape, dtype=np.int64))].reshape(shape)

    def div_(self, x: np.ndarray, divisor: int) -> None:
        np.divide(x, x.dtype.type(divisor), out=x)

    def clone(self, x: np.ndarray) -> np.ndarray:
        return np.array(x, copy=True)

    def div_all(self, xs: Sequence[np.ndarray], divisor: int) -> None:
        for x in xs:
            self.div_(x, divisor)

    def zero_(self, x: np.ndarray) -> None:
        x[...] = 0

    def is_view_of(self, x: Any, view: Any) -> bool:
        if not isinstance(x, np.ndarray) or not isinstance(view, np.ndarray):
            return False
        return (
            x.__array_interface__["data"][0] == view.__array_interface__["data"][0]
            and x.shape == view.shape
            and x.dtype == view.dtype
        )

    def dtype_mismatch(self, flat: np.ndarray, xs: Sequence[Any]) -> tuple[int, str, str] | None:
        for k, x in enumerate(xs):
            dtype = np.asarray(x).dtype
            if dtype != flat.dtype:
                return k, str(dtype), str(flat.dtype)
        return None

    def from_numpy(self, a: np.ndarray, like: Any) -> np.ndarray:
        return np.array(a, copy=True)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)
