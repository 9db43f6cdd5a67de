"""The heap meter sees a tensor allocated inside the measured callable."""

from __future__ import annotations

import time

import pytest

from xgrad.torch_backend.memory import HeapMeter, PeakWatch

torch = pytest.importorskip("torch")

#: 64 MiB: far above what the interpreter allocates on its own while the callable runs.
SIZE = 64 * 2**20


def test_live_counts_a_held_tensor() -> None:
    meter = HeapMeter()
    before = meter.live()
    held = torch.ones(SIZE // 4, dtype=torch.float32)  # ones, not empty: touches its pages
    assert meter.live() - before >= SIZE
    del held


def test_peak_of_a_tensor_freed_inside_the_callable() -> None:
    # Freed before the callable returns, so only the polling thread can have seen it.
    def allocate_and_free() -> None:
        block = torch.ones(SIZE // 4, dtype=torch.float32)
        time.sleep(0.05)  # releases the GIL: the poller runs while the block is held
        del block

    with PeakWatch(HeapMeter()) as watch:
        assert watch.measure(allocate_and_free) >= SIZE


def test_watch_measures_each_call_from_its_own_start() -> None:
    kept: list[object] = []
    with PeakWatch(HeapMeter()) as watch:
        first = watch.measure(lambda: kept.append(torch.ones(SIZE // 4)))
        # The first tensor is still held: it is in the second call's baseline, not its peak.
        second = watch.measure(lambda: None)
    assert first >= SIZE
    assert 0 <= second < SIZE
