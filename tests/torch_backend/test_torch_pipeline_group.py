"""The step's private group: a rank whose peer never starts the step is told within the
runtime's ``timeout`` (``dist.new_group`` alone would wait for the default group's)."""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402

WIDTH = 4


def _peer_never_starts(rank: int, world: int) -> Any:
    """Rank 0 steps with a 1 s timeout; rank 1 stays alive and never calls ``step``."""
    from xgrad.torch_backend.pipeline import PipelineRuntime

    torch.manual_seed(0)
    rt = PipelineRuntime(
        xp.gpipe(world, 2), [nn.Linear(WIDTH, WIDTH)], nn.functional.mse_loss, timeout=1.0
    )
    if rank == 1:
        time.sleep(6.0)
        return "idle"
    start = time.monotonic()
    try:
        rt.step(torch.zeros(4, WIDTH))
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok"


def test_a_peer_that_never_starts_the_step_is_named_within_the_timeout() -> None:
    from ranks import run_ranks

    results, _ = run_ranks(_peer_never_starts, 2, timeout=30)
    status, (kind, text, seconds) = results[0]
    assert status == "ok" and kind.startswith("Rank"), results
    assert "the start of the step" in text, text
    assert seconds < 5.0, seconds  # the 1 s timeout and a loaded machine, not 30 minutes
    assert results[1] == ("ok", "idle"), results
