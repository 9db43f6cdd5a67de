"""A checkpointed stage whose forward reads a buffer it also updates, on two gloo ranks.

A recomputed forward must redo the first one's arithmetic. Before, it ran on copies of
the buffers as the first forward *left* them: a running scale (``y = x * s``, then ``s``
updated) or ``spectral_norm``'s power-iteration vectors gave the recomputation other
numbers than the forward that made the loss, and the gradients were wrong without a word
(relative error 0.23 with the scale under ``except_last``; ``never`` was exact). Now the
buffers a checkpointed forward changes are copied before it and its recomputation starts
from those copies, while the buffers keep what the first forward left, as in the
unpipelined model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

import xgrad.pipeline as xp
from xgrad.torch_backend.pipeline_recompute import BufferSnapshot, kept_buffers
from xgrad.torch_backend.spawn import spawn

WIDTH, BATCH, MICRO = 5, 8, 4


class _RunningScale(nn.Module):
    """``y = x * s``, then ``s`` moves toward the batch's mean magnitude (in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.s.clone()
        if self.training:
            with torch.no_grad():
                self.s.mul_(0.5).add_(0.5 * x.abs().mean())
        return y


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    first = nn.Sequential(spectral_norm(nn.Linear(WIDTH, WIDTH)), _RunningScale())
    return [first.double(), nn.Linear(WIDTH, WIDTH).double()]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)


def _state(m: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in m.parameters()] + [b.clone() for b in m.buffers()]


def _run(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    from xgrad.torch_backend.pipeline import PipelineRuntime

    x, y = _data()
    out = {}
    for mode in ("never", "except_last", "always"):
        stage = _stages()[rank]
        rt = PipelineRuntime(
            xp.make("1f1b", 2, MICRO), [stage], nn.functional.mse_loss, checkpoint=mode, timeout=30
        )
        rt.step(x if rank == 0 else None, y if rank == 1 else None)
        out[mode] = _state(stage)
    return out


def test_a_recomputed_forward_starts_from_the_buffers_its_first_run_found() -> None:
    ref = _stages()  # unpipelined, microbatch by microbatch
    x, y = _data()
    for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True):
        (nn.functional.mse_loss(ref[1](ref[0](xm)), ym) / MICRO).backward()
    results = spawn(_run, 2, timeout=120)
    for rank, got in enumerate(results):
        want = _state(ref[rank])
        for mode, state in got.items():
            assert len(state) == len(want)
            for a, b in zip(state, want, strict=True):
                assert torch.allclose(a, b, rtol=1e-12, atol=1e-14), (rank, mode)


def test_the_snapshot_keeps_only_what_the_forward_changed_and_shares_a_shared_buffer() -> None:
    scale = _RunningScale()
    shared = torch.zeros(3)
    outer = nn.Module()
    outer.scale = scale
    outer.a, outer.b = nn.Module(), nn.Module()
    outer.a.register_buffer("t", shared)
    outer.b.register_buffer("t", shared)
    snapshot = BufferSnapshot(outer)
    scale(torch.full((2,), 3.0, dtype=torch.float64))  # s: 1 -> 2
    before = snapshot.changed()
    assert list(before) == [(id(scale._buffers), "s")]
    assert float(before[(id(scale._buffers), "s")]) == 1.0 and float(scale.s) == 2.0
    seen: dict[str, Any] = {}
    with kept_buffers(outer, before):
        seen["s"] = float(scale.s)  # the recomputation reads what the first run found
        seen["shared"] = outer.a.t is outer.b.t and outer.a.t is not shared
        scale(torch.full((2,), 5.0, dtype=torch.float64))
    assert seen == {"s": 1.0, "shared": True}
    assert float(scale.s) == 2.0 and outer.a.t is shared and outer.b.t is shared


def test_a_buffer_replaced_by_later_forwards_is_found_by_its_place() -> None:
    """Microbatch 1's forward replaces the buffer microbatch 0's forward had replaced,
    before microbatch 0 is recomputed: its snapshot still gives what it first found."""

    class Replacing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("s", torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * self.s
            self.s = self.s + 1  # a new tensor each time, as `self.s = ...` makes
            return y

    m = Replacing()
    first = BufferSnapshot(m)
    m(torch.ones(1))  # microbatch 0: s 1 -> 2
    mb0 = first.changed()
    second = BufferSnapshot(m)
    m(torch.ones(1))  # microbatch 1: s 2 -> 3
    mb1 = second.changed()
    with kept_buffers(m, mb0):
        assert float(m.s) == 1.0
    with kept_buffers(m, mb1):
        assert float(m.s) == 2.0
    assert float(m.s) == 3.0
