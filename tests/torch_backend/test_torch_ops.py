"""The reducer's array operations on torch tensors: copies, scaling as PyTorch's reducer rounds, views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xgrad.torch_backend.ops import TorchArrayOps


def test_ops_copy_scale_and_views() -> None:
    ops = TorchArrayOps()
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(4.0)
    flat = ops.new_flat([a, b], 10)
    assert flat.shape == (10,) and flat.dtype == torch.float32 and not flat.any()
    ops.copy_to(ops.view(flat, 0, a), a, 0.5)
    ops.copy_to(ops.view(flat, 6, b), b)
    assert flat.tolist() == [0, 0.5, 1, 1.5, 2, 2.5, 0, 1, 2, 3]
    view = ops.view(flat, 6, b)
    assert ops.is_view_of(view, ops.view(flat, 6, b))
    assert not ops.is_view_of(b, view)
    ops.div_(view, 2)
    assert flat[6:].tolist() == [0, 0.5, 1, 1.5]
    ops.copy_to(flat, torch.ones(10))
    assert flat.tolist() == [1.0] * 10
    assert ops.nbytes(a) == 24 and ops.key(a) == (torch.float32, torch.device("cpu"))
    np.testing.assert_array_equal(ops.to_numpy(ops.from_numpy(np.arange(3), flat)), [0, 1, 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_ops_scaled_copy_rounds_like_pytorchs_reducer(dtype: torch.dtype) -> None:
    """PyTorch's reducer multiplies by a wrapped double ``1 / world_size`` while copying."""
    torch.manual_seed(0)
    ops = TorchArrayOps()
    g = torch.randn(50).to(dtype)
    flat = torch.zeros(50, dtype=dtype)
    ops.copy_to(flat, g, 1 / 3)
    assert torch.equal(flat, g * (1 / 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_ops_batched_scaled_copy_rounds_like_pytorchs_reducer(dtype: torch.dtype) -> None:
    """Small gradients copied then scaled in fused calls (a cached 0-dim factor) round as
    PyTorch's one multiply-while-copying per gradient does; outputs of mixed dtypes too."""
    torch.manual_seed(0)
    ops = TorchArrayOps()
    grads = [torch.randn(n).to(dtype) for n in (7, 128, 33)]
    flat = torch.zeros(168, dtype=dtype)
    outs = list(flat.split([7, 128, 33]))
    for _ in range(2):  # the first call caches the factor, the second uses it
        ops.copy_all(outs, grads, 1 / 3)
        for out, g in zip(outs, grads, strict=True):
            assert torch.equal(out, g * (1 / 3))
    mixed = [torch.zeros(5, dtype=dtype), torch.zeros(5, dtype=torch.float64)]
    sources = [torch.randn(5).to(dtype), torch.randn(5, dtype=torch.float64)]
    ops.copy_all(mixed, sources, 1 / 3)
    for out, g in zip(mixed, sources, strict=True):
        assert torch.equal(out, g * (1 / 3))


def test_views_take_a_dense_parameters_strides_as_pytorchs_reducer_does() -> None:
    ops = TorchArrayOps()
    flat = torch.arange(2 + 2 * 3 * 4 * 4 + 12 + 8, dtype=torch.float32)
    conv = torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last)
    weight = torch.zeros(4, 3).t()  # a transposed weight: dense, not contiguous
    gappy = torch.zeros(4, 4)[:, :2]  # not dense: a plain row-major view
    views = [ops.view(flat, 2, conv), ops.view(flat, 98, weight), ops.view(flat, 110, gappy)]
    for view, like, offset in zip(views, (conv, weight, gappy), (2, 98, 110), strict=True):
        assert view.shape == like.shape
        assert view.data_ptr() == flat[offset:].data_ptr()
    assert views[0].stride() == conv.stride() and views[1].stride() == weight.stride()
    assert views[2].is_contiguous()
    # In memory order: the buffer's next slot holds the element next in the parameter's memory.
    assert views[0][0, 1, 0, 0].item() == 3.0 and views[1][1, 0].item() == 99.0
    assert ops.is_view_of(views[0], views[0]) and ops.numel(views[0]) == conv.numel()
