"""The reducer's plain types: a ``GradBucket`` as a communication hook sees it."""

from __future__ import annotations

import numpy as np

from xgrad.reducer_types import GradBucket


def _bucket() -> GradBucket[np.ndarray]:
    flat = np.arange(10, dtype=np.float32)
    grads = [flat[0:6].reshape(2, 3), flat[6:10].reshape(4)]
    return GradBucket(0, flat, grads, ["w", "b"], True)


def test_set_buffer_makes_the_gradients_views_of_the_new_buffer() -> None:
    """As PyTorch's GradBucket: a hook wrapped in another that swaps the buffer (its
    ``fp16_compress_wrapper``) reads the gradients in the new buffer's dtype."""
    bucket = _bucket()
    half = bucket.buffer().astype(np.float16)
    bucket.set_buffer(half)
    grads = bucket.gradients()
    assert [g.dtype for g in grads] == [np.float16, np.float16]
    assert [g.shape for g in grads] == [(2, 3), (4,)]
    grads[1][0] = -1  # views: a write shows in the buffer
    assert half[6] == -1
    np.testing.assert_array_equal(grads[0].ravel(), np.arange(6, dtype=np.float16))


def test_a_buffer_of_another_length_leaves_the_gradients() -> None:
    bucket = _bucket()
    before = bucket.gradients()
    bucket.set_buffer(np.zeros(3, np.float32))  # a compressed buffer
    assert bucket.gradients() is before
    assert bucket.buffer().shape == (3,)
