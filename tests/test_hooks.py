"""Communication hooks written once: PyTorch's arithmetic, on NumPy ranks, input never written."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from xgrad.hooks import (
    HOOK_NAMES,
    HOOKS,
    Then,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    resolve_hook,
)
from xgrad.reducer import GradBucket
from xgrad.reference import ReferenceComm, spawn

#: per-rank buffers whose sums round differently in float32, float16 and bfloat16.
RANKS = [np.array([1.0 + 2.0**-11, 3.0, 1e-3], np.float32), np.array([1.0, 5.0, 2e-3], np.float32)]


def _reduce(factory, world: int = 2) -> list[tuple[np.ndarray, np.ndarray]]:  # type: ignore[no-untyped-def]
    def body(comm: ReferenceComm) -> tuple[np.ndarray, np.ndarray]:
        buffer = RANKS[comm.rank].copy()
        before = buffer.copy()
        out = factory(comm)(GradBucket(0, buffer, [buffer], [None], True)).wait()
        np.testing.assert_array_equal(buffer, before)  # the hook never writes its input
        return np.asarray(out), buffer

    return spawn(body, world)


def test_allreduce_divides_first_then_sums() -> None:
    expected = RANKS[0] / np.float32(2) + RANKS[1] / np.float32(2)
    for out, _ in _reduce(allreduce_hook):
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(
    ("factory", "wire"),
    [(fp16_compress_hook, np.float16), (bf16_compress_hook, ml_dtypes.bfloat16)],
)
def test_compression_casts_divides_sums_in_the_wire_dtype_and_casts_back(factory, wire) -> None:  # type: ignore[no-untyped-def]
    parts = [(r.astype(wire) / wire(2)).astype(wire) for r in RANKS]
    expected = (parts[0] + parts[1]).astype(wire).astype(np.float32)
    outs = _reduce(factory)
    for out, _ in outs:
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out, expected)
    exact = (RANKS[0].astype(np.float64) + RANKS[1]) / 2
    assert not np.array_equal(outs[0][0], exact.astype(np.float32))  # the loss is visible


def test_every_array_api_hook_has_a_name_in_the_one_list() -> None:
    assert set(HOOKS) <= set(HOOK_NAMES)
    assert HOOK_NAMES == ("allreduce", "fp16", "bf16", "powersgd")


def test_resolve_hook_by_name_factory_or_none() -> None:
    def body(comm: ReferenceComm) -> bool:
        assert resolve_hook(None, comm) is None
        assert callable(resolve_hook("fp16", comm)) and callable(resolve_hook(allreduce_hook, comm))
        with pytest.raises(ValueError, match=r"hook='int8' is not one of \['allreduce'"):
            resolve_hook("int8", comm)
        with pytest.raises(TypeError, match="hook=3"):
            resolve_hook(3, comm)  # type: ignore[arg-type]
        return True

    assert spawn(body, 1) == [True]


def test_then_applies_its_function_on_wait() -> None:
    class Done:
        def wait(self) -> int:
            return 20

    assert Then(Done(), lambda v: v + 1).wait() == 21
