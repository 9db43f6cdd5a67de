"""Keep numpy's BLAS on one thread while simulated ranks run (they already share the cores).

Every simulated rank is a thread calling numpy; with OpenBLAS's own thread pool behind each
matrix product, a few ranks oversubscribe the machine (measured: 8 ranks on 2 cores ran
25 times slower). OpenBLAS reads its thread count once, at load, so it is set here through
its C API, the way ``threadpoolctl`` does; other BLAS libraries are left alone.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

_lock = threading.Lock()
_depth = 0
_saved = 0


def _openblas() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """``(get, set)`` of the OpenBLAS numpy loaded, or None if there is none to find."""
    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for path in sorted(libs.glob("*openblas*")) if libs.is_dir() else []:
        lib = ctypes.CDLL(str(path))
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", "_64_", ""):
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    get.restype = ctypes.c_int
                    put.argtypes = [ctypes.c_int]
                    return get, put
    return None


_API = _openblas()


def blas_threads() -> int | None:
    """OpenBLAS's current thread count (None when numpy does not use a findable OpenBLAS)."""
    return None if _API is None else int(_API[0]())


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """One BLAS thread inside the block; nested and concurrent blocks share one setting."""
    global _depth, _saved
    if _API is None:
        yield
        return
    get, put = _API
    with _lock:
        if _depth == 0:
            _saved = int(get())
            put(1)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                put(_saved)
