"""The virtual clock against the alpha-beta formula of ring allreduce."""

from __future__ import annotations

import numpy as np
import pytest

from xgrad.reference import LinkModel, ReferenceComm, World, spawn

ALPHA = 5e-6
BETA = 1.0 / 10e9  # 10 GB/s


def ring(nbytes: int, n: int) -> float:
    return 2 * (n - 1) * ALPHA + 2 * (n - 1) / n * nbytes * BETA


def test_link_model_formula() -> None:
    link = LinkModel(ALPHA, BETA)
    assert link.allreduce_seconds(1000, 1) == 0.0
    assert link.allreduce_seconds(4_000_000, 64) == pytest.approx(126 * 5e-6 + 126 / 64 * 4e-4)
    assert LinkModel.from_bandwidth(1e-6, 1e9).message_seconds(1000) == pytest.approx(2e-6)
    with pytest.raises(ValueError, match="alpha=-1"):
        LinkModel(-1, 0)


@pytest.mark.parametrize("world_size", [2, 8, 64])
def test_allreduces_queue_on_one_link(world_size: int) -> None:
    # Rank r computes r microseconds, then launches two allreduces of 8 KiB and 80 KiB.
    world = World(world_size, link=LinkModel(ALPHA, BETA))
    clock = world.clock
    assert clock is not None

    def body(comm: ReferenceComm) -> tuple[float, float]:
        clock.advance(comm.rank, comm.rank * 1e-6)
        a = comm.allreduce(np.zeros(1024))
        b = comm.allreduce(np.zeros(10240))
        b.wait()
        after_b = comm.now()
        a.wait()
        return after_b, comm.now()

    results = spawn(body, world_size, world=world)
    start = (world_size - 1) * 1e-6  # the last rank to launch
    first = start + ring(8192, world_size)
    second = first + ring(81920, world_size)  # waits for the link, not only for the ranks
    for after_b, after_a in results:
        assert after_b == pytest.approx(second, rel=1e-12)
        assert after_a == after_b  # waiting for an earlier, finished collective costs nothing


def test_compute_overlaps_communication() -> None:
    world = World(4, link=LinkModel(ALPHA, BETA), flops_per_second=1e9)
    clock = world.clock
    assert clock is not None

    def body(comm: ReferenceComm) -> float:
        work = comm.allreduce(np.zeros(1 << 20))
        clock.compute(comm.rank, 1e6)  # 1 ms of compute while the allreduce runs
        work.wait()
        return comm.now()

    cost = ring(8 << 20, 4)
    for t in spawn(body, 4, world=world):
        assert t == pytest.approx(max(cost, 1e-3))
