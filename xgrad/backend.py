"""The Backend and Comm protocols, and the registry that finds backends by name.

The core talks to a process group only through :class:`Comm`, so the same reducer runs
on c10d, on simulated in-process ranks, or on a package outside this repository. Backends
are registered by name and imported only when asked for, so ``import xgrad`` never pulls
in torch or jax.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

ENTRY_POINT_GROUP = "xgrad.backends"


@runtime_checkable
class Work(Protocol):
    """An in-flight collective (a ``torch.futures.Future`` already fits)."""

    def wait(self) -> Any:
        """Block until done (bounded by the comm's timeout) and return the result."""
        ...


@runtime_checkable
class Comm(Protocol):
    """What the reducer needs of a process group."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def allreduce(self, buffer: Any) -> Work:
        """Start an asynchronous SUM of ``buffer`` over all ranks."""
        ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s ``obj`` on every rank."""
        ...

    def allgather_object(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj``, indexed by rank."""
        ...


class Backend(Protocol):
    """What :func:`get_backend` returns: a module (or object) that says if it can run."""

    def available(self) -> bool: ...


#: name -> "module.path" (imported lazily), or the already-imported module.
_REGISTRY: dict[str, str | ModuleType] = {}


def register_backend(name: str, target: str | ModuleType) -> None:
    """Register a backend under ``name``; ``target`` is a module or its dotted path.

    Raises:
        ValueError: if ``name`` is empty or already taken (names are never overwritten,
            so two packages cannot silently shadow each other).
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"backend {name!r} is already registered")
    _REGISTRY[name] = target


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def list_backends() -> list[str]:
    """Names of every known backend: built in, registered, or from entry points."""
    return sorted(set(_REGISTRY) | set(_entry_points()))


def get_backend(name: str) -> Any:
    """Import (once) and return the backend registered as ``name``.

    Raises:
        KeyError: for an unknown name, listing the names that exist.
    """
    target = _REGISTRY.get(name)
    if target is None:
        entry = _entry_points().get(name)
        if entry is None:
            raise KeyError(
                f"unknown xgrad backend {name!r}; known backends: {', '.join(list_backends())}"
            )
        loaded = entry.load()
        target = loaded if isinstance(loaded, ModuleType) else importlib.import_module(entry.value)
        _REGISTRY[name] = target
    if isinstance(target, str):
        target = importlib.import_module(target)
        _REGISTRY[name] = target
    return target


def lazy_attributes(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports each exported name's module on first use.

    A backend package assigns it to ``__getattr__`` so that importing the package (as
    ``xgrad backends`` does to ask ``available()``) does not import its framework.

    Args:
        package: the package's ``__name__``.
        exports: public name -> the module that defines it.
    """

    def __getattr__(attr: str) -> Any:
        module = exports.get(attr)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {attr!r}")
        value = getattr(importlib.import_module(module), attr)
        setattr(sys.modules[package], attr, value)  # later lookups skip this function
        return value

    return __getattr__


def backend_available(name: str) -> tuple[bool, str]:
    """Whether backend ``name`` imports and can run here, with the reason when not."""
    try:
        backend = get_backend(name)
    except ImportError as err:
        return False, f"cannot import: {err}"
    check = getattr(backend, "available", None)
    if check is None:
        return True, ""
    ok = bool(check())
    return ok, "" if ok else "its available() says no"


register_backend("reference", "xgrad.reference")
register_backend("torch", "xgrad.torch_backend")
register_backend("jax", "xgrad.jax_backend")
