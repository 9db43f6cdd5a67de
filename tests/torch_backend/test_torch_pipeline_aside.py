"""A failed step's poison reaches a peer still computing, even when the runtime that
failed is dropped at once (a retry loop that makes a fresh ``PipelineRuntime``).

The poison sends of a failed step stay pending until the peer posts their receives; the
runtime held them, so freeing it dropped them: rank 0, slower than rank 1's failure,
waited its whole timeout for a message that never came, and the next step failed on
rank 1's timeout at its start (seen once in CI, on the misuse test's retry loop).
"""

from __future__ import annotations

import gc
import time
import warnings
from typing import Any

import torch
from torch import nn

import xgrad.pipeline as xp
from xgrad.torch_backend.spawn import spawn

_TIMEOUT = 15.0
_SLOW = 1.0  # rank 0's second forward sleeps this long: it posts B0's receive after it


class _SlowSecond(nn.Module):
    """A linear stage whose second forward is slow (rank 0's F1)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            time.sleep(_SLOW)
        return self.lin(x)


def _fail(a: Any, b: Any) -> torch.Tensor:
    raise ValueError("loss refused")


def _dropped(rank: int, world: int) -> dict[str, Any]:
    from xgrad.torch_backend.pipeline import PipelineRuntime
    from xgrad.torch_backend.pipeline_aside import set_aside_count

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    stage = _SlowSecond()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    out: dict[str, Any] = {}
    for attempt in range(2):
        rt = PipelineRuntime(xp.make("1f1b", 2, 2), [stage], _fail, timeout=_TIMEOUT)
        # Receives posted only when needed: rank 0 posts B0's after its slow F1, well
        # after rank 1 failed at 1F0 and sent its poison.
        rt.post_ahead = 1
        stage.calls = 0
        start = time.monotonic()
        try:
            rt.step(x if rank == 0 else None, y if rank == 1 else None)
            out[f"failed {attempt}"] = "no error"
        except Exception as exc:
            out[f"failed {attempt}"] = str(exc)
        out[f"failed {attempt} s"] = time.monotonic() - start
        out[f"set aside {attempt}"] = set_aside_count()
        del rt
        gc.collect()  # the failed runtime, its wire and its pending sends freed now
        rt = PipelineRuntime(
            xp.make("1f1b", 2, 2), [stage], nn.functional.mse_loss, timeout=_TIMEOUT
        )
        start = time.monotonic()
        loss = rt.step(x if rank == 0 else None, y if rank == 1 else None)
        out[f"next {attempt} s"] = time.monotonic() - start
        out[f"next {attempt} loss"] = None if loss is None else float(loss)
        out[f"left {attempt}"] = set_aside_count()
        del rt
        gc.collect()
    return out


def test_a_dropped_runtime_still_poisons_its_peers() -> None:
    results = spawn(_dropped, 2, timeout=120)
    for out in results:
        for attempt in range(2):
            # Rank 1's error on both ranks, rank 0's after its slow forward, not its timeout
            # (was: rank 0 timed out, then both failed the next step on rank 1's timeout).
            assert "rank 1: 1F0 failed: ValueError" in out[f"failed {attempt}"], out
            assert "loss refused" in out[f"failed {attempt}"], out
            assert out[f"failed {attempt} s"] < _SLOW + 5.0, out
            # Kept apart from the runtime until every rank started a later step, then gone.
            assert out[f"set aside {attempt}"] == 1, out
            assert out[f"left {attempt}"] == 0, out
            assert out[f"next {attempt} s"] < _TIMEOUT / 2, out
    assert results[0]["next 0 loss"] is None
    assert results[1]["next 0 loss"] == results[1]["next 1 loss"]
