"""The pipeline tests' comparison of gradients with the unpipelined model's (float64)."""

from __future__ import annotations

import torch


def assert_close(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    what: str,
    *,
    same_keys: bool = True,
) -> None:
    """Every tensor of ``want`` equal to ``got``'s to 1e-12 (and, with ``same_keys``, the
    same names on both sides): the gap, and both values, named where they differ."""
    if same_keys:
        assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    bad = {
        k: (got[k] - want[k]).abs().max().item()
        for k in want
        if not torch.allclose(got[k], want[k], rtol=1e-12, atol=1e-12)
    }
    assert not bad, f"{what}: {bad} (got {[got[k] for k in bad]}, want {[want[k] for k in bad]})"
