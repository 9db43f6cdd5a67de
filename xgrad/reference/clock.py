"""A virtual clock with an alpha-beta link model, for timing experiments at any world size.

Each simulated rank has its own virtual time. Computation advances it by a modelled
duration; a collective starts when every rank has launched it *and* the link has finished
the previous one (one collective at a time, as on one NCCL stream), takes the modelled
time, and a rank that waits for it jumps to its finish. Nothing depends on how fast this
machine is, so 64 ranks can be timed on two cores.

Ring allreduce of ``n`` bytes over ``N`` ranks (reduce-scatter then all-gather, each
``N - 1`` steps moving ``n / N`` bytes)::

    T(n, N) = 2 (N - 1) alpha + 2 (N - 1) / N * n * beta
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkModel:
    """The alpha-beta cost of one message: ``alpha + nbytes * beta`` seconds.

    Attributes:
        alpha: per-message latency in seconds.
        beta: seconds per byte (the inverse of the bandwidth).
    """

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"LinkModel(alpha={self.alpha}, beta={self.beta}) must be >= 0")

    @classmethod
    def from_bandwidth(cls, alpha: float, bandwidth: float) -> LinkModel:
        """From a latency (seconds) and a bandwidth (bytes per second)."""
        if bandwidth <= 0:
            raise ValueError(f"bandwidth={bandwidth} bytes/s must be > 0")
        return cls(alpha, 1.0 / bandwidth)

    def message_seconds(self, nbytes: int) -> float:
        return self.alpha + nbytes * self.beta

    def allreduce_seconds(self, nbytes: int, world_size: int) -> float:
        """Ring allreduce: ``2(N-1)·alpha + 2(N-1)/N·nbytes·beta`` (0 for one rank)."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        n = world_size
        return 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * nbytes * self.beta


@dataclass(frozen=True)
class LinkEvent:
    """One allreduce on the link: when it started and finished, and its bytes per rank."""

    start: float
    finish: float
    nbytes: int


class VirtualClock:
    """Per-rank virtual time plus one shared link that runs collectives in launch order.

    Args:
        world_size: number of ranks.
        link: the link's cost model.
        flops_per_second: the modelled compute rate (used by :meth:`compute`).
    """

    def __init__(self, world_size: int, link: LinkModel, *, flops_per_second: float = 1e12):
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if flops_per_second <= 0:
            raise ValueError(f"flops_per_second={flops_per_second} must be > 0")
        self.world_size = world_size
        self.link = link
        self.flops_per_second = flops_per_second
        self._now = [0.0] * world_size
        self._link_free = 0.0
        self._lock = threading.Lock()
        #: every allreduce the link carried, in order.
        self.log: list[LinkEvent] = []

    def now(self, rank: int) -> float:
        return self._now[rank]

    def advance(self, rank: int, seconds: float) -> None:
        """Rank ``rank`` spends ``seconds`` computing."""
        if seconds < 0:
            raise ValueError(f"advance(rank={rank}, seconds={seconds}): must be >= 0")
        self._now[rank] += seconds

    def compute(self, rank: int, flops: float) -> None:
        """Rank ``rank`` does ``flops`` floating-point operations."""
        self.advance(rank, flops / self.flops_per_second)

    def wait_until(self, rank: int, t: float) -> None:
        """Rank ``rank`` blocks until virtual time ``t`` (no-op if already later)."""
        if t > self._now[rank]:
            self._now[rank] = t

    def schedule_allreduce(self, launch_times: list[float], nbytes: int) -> float:
        """Place an allreduce on the link once every rank launched it; returns its finish.

        Must be called in collective order (the reference world does: a collective is
        complete only after every earlier one is).
        """
        with self._lock:
            start = max(max(launch_times), self._link_free)
            finish = start + self.link.allreduce_seconds(nbytes, self.world_size)
            self._link_free = finish
            self.log.append(LinkEvent(start, finish, nbytes))
            return finish

    def reset(self) -> None:
        """Every rank back to time 0 and the link idle (between experiment runs)."""
        with self._lock:
            self._now = [0.0] * self.world_size
            self._link_free = 0.0
            self.log.clear()
