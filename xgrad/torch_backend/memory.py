"""CPU memory for the benchmarks: heap bytes in use now, and their peak while a callable runs."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["HeapMeter", "PeakWatch"]

#: Linux's per-process memory counters, in pages; the fallback's source.
_STATM = "/proc/self/statm"


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


class HeapMeter:
    """Bytes currently in use through the C allocator, which holds torch's CPU tensors.

    glibc's ``mallinfo2`` (glibc 2.33 and later) counts bytes handed out and not yet
    freed, over all arenas plus the large blocks served by ``mmap``: a tensor shows up the
    moment it is allocated and leaves the moment it is freed, whatever the allocator keeps
    cached. Without it (older glibc, musl) the fallback is the resident set size from
    ``/proc/self/statm``: coarser, since pages count only once touched and freed memory the
    allocator keeps stays resident, so a step that reuses cached memory can read as 0.
    Neither exists outside Linux, where construction raises ``OSError``.
    """

    def __init__(self) -> None:
        self._mallinfo2: Callable[[], Any] | None = None
        path = ctypes.util.find_library("c")
        fn = getattr(ctypes.CDLL(path), "mallinfo2", None) if path is not None else None
        if fn is not None:
            fn.restype = _MallInfo2
            self._mallinfo2 = fn
        elif not os.path.exists(_STATM):
            raise OSError(f"no glibc mallinfo2 and no {_STATM}: cannot measure CPU memory here")

    @property
    def source(self) -> str:
        """What :meth:`live` reads, for a benchmark's legend."""
        return "glibc mallinfo2" if self._mallinfo2 is not None else "resident set size"

    def live(self) -> int:
        """Bytes in use now, for the whole process."""
        if self._mallinfo2 is not None:
            info = self._mallinfo2()
            return int(info.uordblks + info.hblkhd)
        with open(_STATM) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakWatch:
    """Peak of :meth:`HeapMeter.live` above a baseline, polled by a thread while armed.

    A thread rather than reads at chosen points of the measured code: the interesting
    moment (deep in a backward pass, inside a library's schedule) has no hook common to
    every implementation compared, and torch releases the GIL in its kernels and in the
    autograd engine, so the poller gets to run throughout. Use as a context manager (the
    thread lives inside it) and call :meth:`measure` any number of times; the thread spins
    while in the context, so keep timed work outside it.
    """

    def __init__(self, meter: HeapMeter) -> None:
        self._meter = meter
        # Guards the peak and the armed flag, so a poll begun during one measurement
        # cannot write its reading into the next one's baseline.
        self._lock = threading.Lock()
        self._armed = False
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> PeakWatch:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(0)  # yield the GIL between readings

    def sample(self) -> None:
        """Take a reading now (measured code may call it at moments it knows matter)."""
        with self._lock:
            if self._armed:
                self._peak = max(self._peak, self._meter.live())

    def measure(self, fn: Callable[[], object]) -> int:
        """Run ``fn``; return the peak bytes in use above those in use just before it."""
        with self._lock:
            start = self._meter.live()
            self._peak = start
            self._armed = True
        try:
            fn()
        finally:
            with self._lock:
                self._armed = False
                peak = max(self._peak, self._meter.live())
        return peak - start
