"""The reference backend's simulated ranks: exact collectives, mismatches, timeouts."""

from __future__ import annotations

import numpy as np
import pytest

from xgrad.backend import Comm, get_backend
from xgrad.reference import RankError, ReferenceComm, World, spawn


def test_registered_and_available() -> None:
    backend = get_backend("reference")
    assert backend.available() is True
    assert backend.name == "reference"
    assert isinstance(World(2).comm(1), Comm)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_allreduce_sums_in_rank_order(world_size: int) -> None:
    # float32 values whose sum depends on the order: the result must be exactly 0+1+...+N-1.
    rng = np.random.default_rng(world_size)
    values = [
        (rng.standard_normal(64) * 10.0 ** rng.integers(-6, 6, 64)).astype(np.float32)
        for _ in range(world_size)
    ]
    expected = values[0].copy()
    for v in values[1:]:
        expected += v

    def body(comm: ReferenceComm) -> np.ndarray:
        buf = values[comm.rank].copy()
        work = comm.allreduce(buf)
        buf[:] = -1  # written after the launch: must not leak into the sum
        out = work.wait()
        assert out is buf
        return buf

    for result in spawn(body, world_size):
        assert result.tobytes() == expected.tobytes()


def test_object_collectives() -> None:
    def body(comm: ReferenceComm) -> tuple:
        got = comm.broadcast_object({"from": comm.rank}, src=2)
        everyone = comm.allgather_object(comm.rank * 10)
        comm.barrier()
        return got, everyone

    for got, everyone in spawn(body, 3):
        assert got == {"from": 2}
        assert everyone == [0, 10, 20]


def test_mismatched_collectives_name_the_ranks() -> None:
    def body(comm: ReferenceComm) -> None:
        if comm.rank == 0:
            comm.allreduce(np.zeros(3)).wait()
        else:
            comm.allgather_object("x")

    with pytest.raises(RankError, match="called allgather but rank 0 called allreduce"):
        spawn(body, 2, timeout=5.0)


def test_mismatched_shapes_name_the_ranks() -> None:
    def body(comm: ReferenceComm) -> None:
        comm.allreduce(np.zeros(3 + comm.rank)).wait()

    with pytest.raises(RankError, match=r"rank 1 gave shape \(4,\) dtype float64, rank 0 gave"):
        spawn(body, 2, timeout=5.0)


def test_a_rank_that_never_joins_times_out_naming_ranks() -> None:
    def body(comm: ReferenceComm) -> None:
        if comm.rank != 2:
            comm.allreduce(np.ones(2)).wait()

    # Ranks 0 and 1 both wait; whichever times out first aborts the world and is named.
    with pytest.raises(RankError, match=r"rank [01]: allreduce .* within 0.2s; ranks \[2\] never"):
        spawn(body, 3, timeout=0.2)


def test_a_failing_rank_aborts_the_others_quickly() -> None:
    def body(comm: ReferenceComm) -> None:
        if comm.rank == 1:
            raise KeyError("missing weights on this rank")
        comm.allreduce(np.ones(2)).wait()

    with pytest.raises(RankError, match="rank 1 failed: KeyError") as info:
        spawn(body, 4, timeout=30.0)
    assert info.value.rank == 1


def test_a_rank_busy_outside_any_collective_does_not_hang_spawn() -> None:
    """Rank 0 never reaches a collective; rank 1 fails: spawn raises rank 1's error after
    the world's timeout, naming rank 0 as left behind, instead of joining it forever."""
    import threading
    import time

    release = threading.Event()

    def body(comm: ReferenceComm) -> None:
        if comm.rank == 1:
            raise KeyError("missing weights on this rank")
        release.wait(60.0)  # busy in its own code: no abort reaches it

    start = time.monotonic()
    try:
        with pytest.raises(RankError, match="rank 1 failed: KeyError") as info:
            spawn(body, 2, timeout=0.3)
    finally:
        release.set()
    assert time.monotonic() - start < 10.0
    assert "ranks [0] were still running 0.3 s after the world was aborted" in str(info.value)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world size=0"):
        World(0)
    with pytest.raises(ValueError, match="rank=3"):
        World(2).comm(3)
    with pytest.raises(TypeError, match="rank 0: allreduce takes a numpy array, got list"):
        World(1).comm(0).allreduce([1.0])
    with pytest.raises(ValueError, match="src=5"):
        World(1).comm(0).broadcast_object(1, src=5)


def test_the_old_argument_order_still_works_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"call spawn\(fn, world_size\)"):
        assert spawn(2, lambda comm: comm.rank) == [0, 1]  # type: ignore[arg-type]
