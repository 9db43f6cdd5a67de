"""Waits that stay hot: a DDP wait polls its collective for a while before it sleeps.

A thread that blocks (a lock, a condition variable, C++ ``work.wait()``) and is woken
when a collective completes pays for it twice: the wake itself (tens of µs here) and then
a stretch of code that runs cold, several times slower than the same code run hot. The
end of the backward pass is exactly that stretch: the last bucket's allreduce completes,
and the write-back, the records and the optimizer step follow at once. A gloo collective
completes on gloo's own thread, so its ``Work.is_completed()`` turns true without
anyone waiting on it, and the waiting thread can poll it instead of sleeping: it is
still running when the result is there.

Polling costs CPU, and takes it from gloo's thread and the other ranks on the same
machine. Between polls the thread calls ``sched_yield`` (which also releases the GIL), so
a runnable thread on its core goes first; and the spin is on by default only where every
rank of the group can have a core of its own while it spins (``LOCAL_WORLD_SIZE``, else
the group's size, at most the CPUs this process may run on). Measured on a 2-core
machine (alternated in one run, 150–200 steps, paired wall-time ratios against blocking
at once): at world size 2 the transformer 0.94–0.96 and the mlp 0.93–1.03 of the step
time, for 3–5% more main-thread CPU; at world size 4 on those 2 cores the mlp 1.05–1.12,
so there it stays off.

A collective of CUDA tensors gets no spin, decided by its tensors' device at each wait
(a default group made without a backend names its backend ``undefined``). On NCCL
``is_completed()`` asks the GPU whether the collective has run, so polling it holds the
host until the GPU has caught up with everything queued before it (the backward pass),
and the CPU can no longer queue the next work ahead; the collective's future completes
when it is queued and its ``wait()`` only orders the current stream, so there is nothing
to gain from it. On an H200 (NCCL, one rank), with the spin on, xgrad took 1.26 of
PyTorch's step on the mlp and 1.12 on the transformer; the run without it is still to be
made.

A spin that outlasts its bound falls back to the blocking wait it replaced, which checks
the failure channel and counts the spin against the timeout: a peer's failure, a dead or
frozen peer and the timeout are seen as soon as before.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

__all__ = ["DEFAULT_SPIN_S", "SPIN_ENV", "resolve_spin", "spin_until"]

#: environment variable that sets the spin, in seconds (``0`` turns it off).
SPIN_ENV = "XGRAD_DDP_SPIN"

#: the spin where it is on by default: longer than most bucket waits of the benchmark's
#: models (a spin that gives up has cost its CPU for nothing), shorter than the failure
#: channel's poll interval.
DEFAULT_SPIN_S = 0.01

_yield: Callable[[], object] = getattr(os, "sched_yield", lambda: time.sleep(0))


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_spin(world_size: int, poll: float, device: str = "cpu") -> float:
    """Seconds a DDP wait polls before it blocks: ``$XGRAD_DDP_SPIN``, else the default.

    The default is :data:`DEFAULT_SPIN_S` (at most ``poll``, the failure channel's
    interval) when each rank on this machine can have a CPU to itself while it spins
    (``$LOCAL_WORLD_SIZE`` ranks, as torchrun sets it, else ``world_size``), and 0 (block
    at once) when they cannot, or for collectives of tensors on ``device`` other than the
    CPU (they run on NCCL, or on gloo's CUDA path: nothing to keep hot).

    Raises:
        ValueError: ``$XGRAD_DDP_SPIN`` or ``$LOCAL_WORLD_SIZE`` is not a number, or the
            spin is negative or not finite.
    """
    env = os.environ.get(SPIN_ENV)
    if env is not None:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{SPIN_ENV}={env!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{SPIN_ENV}={env!r}: expected a finite number of seconds >= 0")
        return value
    if device != "cpu":
        return 0.0
    local = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        ranks = world_size if local is None else int(local)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={local!r} is not a number of ranks") from None
    return min(DEFAULT_SPIN_S, poll) if ranks <= _usable_cpus() else 0.0


def spin_until(done: Callable[[], bool], seconds: float) -> bool:
    """Poll ``done`` for up to ``seconds``, yielding the CPU and the GIL between polls;
    whether it returned true."""
    clock = time.perf_counter
    end = clock() + seconds
    while not done():
        if clock() >= end:
            return False
        _yield()
    return True
