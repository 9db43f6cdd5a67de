"""The stores a failure channel lives in: the protocol it needs, and one in memory.

Kept apart from the channel (:mod:`xgrad.failure`, which re-exports both names): the
torch backend passes the c10d store, which has these methods already; threads standing in
for ranks (tests, the reference backend) share a :class:`MemoryStore`. Backend-neutral.
"""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["KeyValueStore", "MemoryStore"]


class KeyValueStore(Protocol):
    """The store protocol the channel needs (a subset of ``torch.distributed.Store``).

    ``get`` is only called for keys that :meth:`check` found, so it need not block.
    """

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def check(self, keys: list[str]) -> bool: ...

    def delete_key(self, key: str) -> bool: ...


class MemoryStore:
    """A :class:`KeyValueStore` in one process's memory (threads as ranks; tests, reference)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._data[key] = bytes(value)

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = int(self._data.get(key, b"0")) + int(amount)
            self._data[key] = str(value).encode()
            return value

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None
