"""The torch comm's works: every wait bounded, the timeout naming what did not complete."""

from __future__ import annotations

import time

import pytest
import torch

from xgrad.torch_backend.comm import FutureWork


def test_future_work_waits_with_a_bound() -> None:
    done: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    done.set_result([torch.ones(2)])
    assert FutureWork(done, 1.0).wait().tolist() == [1.0, 1.0]
    never: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    start = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"comm hook x on bucket 0 did not complete within 0\.2 s"
    ):
        FutureWork(never, 0.2, name="comm hook x on bucket 0").wait()
    assert time.monotonic() - start < 5
