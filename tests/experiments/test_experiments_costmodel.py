"""The alpha-beta cost model: formulas, bucketing and the iteration timeline by hand."""

from __future__ import annotations

import pytest

from xgrad.experiments.costmodel import (
    buckets_by_cap,
    ddp_iteration,
    ring_allreduce,
    tree_allreduce,
)


def test_ring_and_tree_formulas() -> None:
    assert ring_allreduce(1000, 1, 1e-6, 1e-9) == 0.0
    assert ring_allreduce(1000, 4, 1e-6, 1e-9) == pytest.approx(6e-6 + 1.5 * 1000e-9)
    assert tree_allreduce(1000, 1, 1e-6, 1e-9) == 0.0
    assert tree_allreduce(1000, 8, 1e-6, 1e-9) == pytest.approx(6 * (1e-6 + 1000e-9))
    assert tree_allreduce(1000, 5, 1e-6, 0.0) == pytest.approx(6e-6)  # ceil(log2 5) = 3
    # Latency-bound small messages favour the tree at scale, big ones the ring.
    assert tree_allreduce(8, 1024, 5e-6, 1e-10) < ring_allreduce(8, 1024, 5e-6, 1e-10)
    assert ring_allreduce(1 << 28, 1024, 5e-6, 1e-10) < tree_allreduce(1 << 28, 1024, 5e-6, 1e-10)


def test_bad_sizes_are_named() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        ring_allreduce(1, 0, 1.0, 1.0)
    with pytest.raises(ValueError, match="nbytes=-1"):
        tree_allreduce(-1, 2, 1.0, 1.0)
    with pytest.raises(ValueError, match="cap=0"):
        buckets_by_cap([1, 2], 0)


def test_buckets_fill_in_order_and_big_layers_go_alone() -> None:
    assert buckets_by_cap([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert buckets_by_cap([4, 20, 4], 8) == [[0], [1], [2]]
    assert buckets_by_cap([1, 1, 1], 1000) == [[0, 1, 2]]


def test_iteration_timeline_by_hand() -> None:
    # Forward 1; backward layers 2, 2 (ready at 3 and 5); buckets of one layer each, 3 s.
    comm = lambda nbytes: 3.0  # noqa: E731
    it = ddp_iteration(1.0, [2.0, 2.0], [10, 10], 10, comm)
    # Bucket 0 runs 3..6, bucket 1 waits for the link: 6..9.
    assert (it.iteration, it.compute, it.comm, it.exposed, it.buckets) == (9.0, 5.0, 6.0, 4.0, 2)
    off = ddp_iteration(1.0, [2.0, 2.0], [10, 10], 10, comm, overlap=False)
    assert off.iteration == 11.0 and off.exposed == 6.0
    with pytest.raises(ValueError, match="2 backward times for 1 layer"):
        ddp_iteration(1.0, [2.0, 2.0], [10], 10, comm)
