"""The torch experiments' workers: a link's finish time already passed between two
reads of the clock is no sleep (a negative one raised ``ValueError`` in the overlap
experiment, now and then, on a loaded machine)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from xgrad.torch_backend import paper_workers


def test_a_finish_passed_between_two_clock_reads_is_no_sleep(monkeypatch: Any) -> None:
    clock = iter([9.0, 11.0])  # before the finish at the first read, past it at the second
    slept: list[float] = []
    monkeypatch.setattr(paper_workers.time, "perf_counter", lambda: next(clock, 12.0))
    monkeypatch.setattr(paper_workers.time, "sleep", slept.append)
    paper_workers._sleep_until(10.0)
    assert slept == [1.0]  # one read: the time left then
    paper_workers._sleep_until(10.0)  # read at 11.0
    assert slept == [1.0]
