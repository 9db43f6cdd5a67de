"""allreduce-size: the alpha-beta fit recovers a known link."""

from __future__ import annotations

import pytest

from xgrad.experiments.allreduce_size import fit


@pytest.mark.parametrize("world", [2, 4])
def test_fit_recovers_alpha_and_beta(world: int) -> None:
    alpha, beta = 30e-6, 1 / 2e9
    sizes = [4 << k for k in range(10, 24, 2)]
    times = [2 * (world - 1) * alpha + 2 * (world - 1) / world * s * beta for s in sizes]
    a, b = fit(sizes, times, world)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
