"""xgrad.powersgd: hyperparameters, layout, orthogonalisation and one round, in NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from xgrad.powersgd import PowerSGD, compress, layout, numpy_sampler, orthogonalize


def test_defaults_and_checks_are_pytorchs() -> None:
    config = PowerSGD()
    assert (config.matrix_approximation_rank, config.start_powerSGD_iter) == (1, 1000)
    assert config.use_error_feedback and config.warm_start and not config.stateless
    with pytest.raises(ValueError, match="matrix_approximation_rank=0"):
        PowerSGD(matrix_approximation_rank=0)
    with pytest.raises(ValueError, match=r"start_powerSGD_iter=1: expected > 1 with"):
        PowerSGD(start_powerSGD_iter=1)
    assert PowerSGD(start_powerSGD_iter=1, use_error_feedback=False, warm_start=False).stateless
    with pytest.raises(ValueError, match="min_compression_rate=nan"):
        PowerSGD(min_compression_rate=float("nan"))
    with pytest.raises(TypeError, match="warm_start=1"):
        PowerSGD(warm_start=1)  # type: ignore[arg-type]


def test_layout_compresses_worthwhile_matrices_grouped_by_shape() -> None:
    # (8, 16) and (8, 2, 2, 2, 2) both view as 8x16; (4,) is a column; (3, 3) does not shrink.
    lay = layout([(8, 16), (4,), (3, 3), (32, 8), (8, 2, 2, 2, 2)], 1, 2.0)
    assert lay.compressed == (0, 4, 3)
    assert lay.plain == (1, 2)
    assert lay.matrices == ((8, 16), (8, 16), (32, 8))
    assert lay.q_shapes == ((16, 1), (16, 1), (8, 1))
    assert (lay.length, lay.p_size, lay.q_size) == (128 + 4 + 9 + 256 + 128, 48, 40)
    assert lay.offsets == (0, 128, 132, 141, 397)
    with pytest.raises(ValueError, match=r"gradient 1 of the bucket is a scalar"):
        layout([(2, 2), ()], 1, 2.0)


def test_orthogonalize_gives_orthonormal_columns_and_batches() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 7, 2))
    q = orthogonalize(a)
    for k in range(3):
        assert np.allclose(q[k].T @ q[k], np.eye(2), atol=1e-12)
        # Gram-Schmidt keeps the span of the leading columns (as QR does, up to signs).
        reference, _ = np.linalg.qr(a[k])
        assert np.allclose(np.abs(q[k]), np.abs(reference), atol=1e-12)
    zero = np.zeros((4, 1))
    with np.errstate(invalid="ignore"):
        assert np.isnan(orthogonalize(zero)).all()  # torch divides by zero too
    assert np.array_equal(orthogonalize(zero, 1e-8), zero)


def test_one_round_is_the_power_iteration_averaged_over_ranks() -> None:
    """Two ranks stacked on axis 0; the sum over that axis is the allreduce."""
    rng = np.random.default_rng(1)
    shapes = [(6, 5), (5,), (6, 5)]
    lay = layout(shapes, 1, 1.0)
    flat = rng.standard_normal((2, lay.length))
    q0 = rng.standard_normal(lay.q_size)

    def allreduce(x: np.ndarray) -> np.ndarray:
        return np.broadcast_to(x.sum(axis=0, keepdims=True), x.shape)

    out, q = compress(flat, lay, q0, allreduce, 2)
    assert out.shape == flat.shape and np.array_equal(out[0], out[1])
    mats = flat[:, :30].reshape(2, 6, 5)
    p = orthogonalize(sum(m @ orthogonalize(q0[:5].reshape(5, 1)) for m in mats))
    q_first = sum(m.T @ p for m in mats) / 2
    assert np.allclose(out[0, :30], (p @ q_first.T).ravel(), atol=1e-12)
    assert np.allclose(out[0, 30:35], flat[:, 30:35].mean(axis=0), atol=1e-15)
    assert np.allclose(q[0, :5], q_first.ravel(), atol=1e-12)
    # Rank as large as the matrices: the approximation is exact.
    full = layout(shapes, 5, 0.0)
    exact, _ = compress(flat, full, rng.standard_normal(full.q_size), allreduce, 2)
    assert np.allclose(exact[0], flat.mean(axis=0), atol=1e-12)


def test_numpy_sampler_is_seeded_and_in_the_dtype() -> None:
    a = numpy_sampler(7, [(3, 1), (2, 2)], "float16")
    b = numpy_sampler(7, [(3, 1), (2, 2)], "float16")
    assert [x.shape for x in a] == [(3, 1), (2, 2)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(np.array_equal(x, x.astype(np.float16)) for x in a)
