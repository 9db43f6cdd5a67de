"""The simulated link: the real reduction, then a wait of the alpha-beta time of the message.

It is framework-free and sits in the core, so that the backends' per-rank experiment
workers may use it (they may not import :mod:`xgrad.experiments`).

Loopback gloo on a small machine shares the CPU with the computation it should overlap,
so its timings say more about the scheduler than about a network. With the simulated
link every allreduce still runs for real (the numbers are the real sums), and the bucket
is held until the modelled link would have delivered it, booked when it is launched (so
the real reduction runs inside the modelled time, not on top of it): one message at a time,
each taking the ring allreduce time ``2(N-1)·alpha + 2(N-1)/N·bytes·beta`` (see
:class:`xgrad.reference.LinkModel`), after the previous one finished. Waiting is a
sleep, so it costs no CPU and overlaps with the backward pass exactly as a network would.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from xgrad.reference.clock import LinkModel

__all__ = ["DEFAULT_ALPHA", "DEFAULT_BETA", "SimulatedLink", "make_link"]

#: defaults: 50 us per message and 1 GB/s, a slow datacentre link whose times dominate the
#: noise of a loaded machine yet keep every experiment's wait short.
DEFAULT_ALPHA = 50e-6
DEFAULT_BETA = 1 / 1e9


@dataclass
class SimulatedLink:
    """One shared link with an alpha-beta cost, carrying one allreduce at a time.

    Attributes:
        model: the per-message cost (alpha seconds, beta seconds per byte).
        world_size: ranks taking part (the ring formula's N).
    """

    model: LinkModel
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        self._free = 0.0
        self._lock = threading.Lock()
        self.messages = 0
        self.bytes = 0

    def seconds(self, nbytes: int) -> float:
        """The modelled time of one allreduce of ``nbytes`` per rank."""
        return self.model.allreduce_seconds(nbytes, self.world_size)

    def reserve(self, nbytes: int, now: float | None = None) -> float:
        """Book the link for one allreduce issued at ``now``; returns when it finishes."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            start = max(now, self._free)
            self._free = start + self.seconds(nbytes)
            self.messages += 1
            self.bytes += nbytes
            return self._free

    def wait(self, nbytes: int) -> None:
        """Block until an allreduce of ``nbytes`` issued now would have been delivered."""
        delay = self.reserve(nbytes) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def make_link(kind: str, alpha: float, beta: float, world: int) -> SimulatedLink | None:
    """The simulated link for ``--link sim``; None for the real one."""
    return SimulatedLink(LinkModel(alpha, beta), world) if kind == "sim" else None
