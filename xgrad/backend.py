"""The registry that finds backends by name, and the Backend and Comm protocols it deals in.

The core talks to a process group only through :class:`Comm`, so the same reducer runs
on c10d, on simulated in-process ranks, or on a package outside this repository. A
:class:`Backend` says what it can do — run a data-parallel step (:class:`Step`) with a
bucket plan and a hook on a model of the zoo, through one or more :class:`Runner` — and
what it supports; the crosscheck, the benches and the experiments iterate over the
registry and never name a backend. Backends are registered by name and imported only
when asked for, so ``import xgrad`` never pulls in torch or jax. The protocols are
:mod:`xgrad.backend_protocols`, re-exported here; this module is the registry and what
is looked up in it (benches, truths, samplers, runners).

Example (a package outside this repository; see ``examples/ring_backend``)::

    # pyproject.toml: [project.entry-points."xgrad.backends"] ring = "xgrad_ring"
    # xgrad_ring/__init__.py
    name = "ring"
    def available() -> bool: return True
    def runners() -> tuple[Runner, ...]: return (RingRunner(),)
    def run_ranks(fn, world_size, *, timeout): ...   # fn(comm) on every rank
    def array_ops(): return NumpyOps(), numpy.asarray
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

from xgrad.backend_protocols import Backend as Backend
from xgrad.backend_protocols import Comm as Comm
from xgrad.backend_protocols import Runner as Runner
from xgrad.backend_protocols import Truth as Truth
from xgrad.backend_protocols import Work as Work
from xgrad.backend_protocols import unsupported_by_declaration as unsupported_by_declaration
from xgrad.step import Step as Step
from xgrad.step import StepResult as StepResult

ENTRY_POINT_GROUP = "xgrad.backends"


def backend_benches() -> dict[str, str]:
    """Every registered backend's ``xgrad bench`` targets (target -> module path).

    Raises:
        ValueError: two backends claim one target.
    """
    targets: dict[str, str] = {}
    for name in list_backends():
        try:
            benches = getattr(get_backend(name), "BENCHES", {})
        except ImportError:
            continue  # reported by `xgrad backends`; its benches cannot run anyway
        for target, module in benches.items():
            if target in targets:
                raise ValueError(f"bench target {target!r} is claimed twice (backend {name})")
            targets[target] = module
    return targets


def find_truth(model: str) -> Truth:
    """The float64 truth for ``model``: an independent one if an available backend has it.

    Raises:
        RuntimeError: no available backend can differentiate ``model`` (saying which
            backends were asked).
    """
    found: list[Truth] = []
    asked = []
    for name in list_backends():
        ok, _ = backend_available(name)
        offer = getattr(get_backend(name), "truth", None) if ok else None
        truth = offer() if offer is not None else None
        if truth is not None:
            asked.append(name)
            if truth.covers(model):
                found.append(truth)
    if not found:
        raise RuntimeError(
            f"no float64 truth for model {model!r}: none of the available backends that offer "
            f"one ({', '.join(asked) or 'none'}) differentiates it"
        )
    return sorted(found, key=lambda t: not t.independent)[0]


def find_sampler() -> Any:
    """The PowerSGD random draws a backend offers (its ``powersgd_sampler``), or ``None``.

    PowerSGD starts from random matrices; a backend whose framework draws them its own way
    (torch's ``powerSGD_hook``) offers that sampler, so the float64 model and the other
    backends can replay the very same numbers. ``None``: NumPy's draws.
    """
    for name in list_backends():
        ok, _ = backend_available(name)
        sampler = getattr(get_backend(name), "powersgd_sampler", None) if ok else None
        if sampler is not None:
            return sampler
    return None


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
    """Names of every known backend: built in and registered (in that order), then those
    of entry points (sorted)."""
    return [*_REGISTRY, *sorted(set(_entry_points()) - set(_REGISTRY))]


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
    except KeyError:
        raise
    except Exception as err:  # ImportError, or a plug-in that fails while importing
        return False, f"cannot import: {type(err).__name__}: {err}"
    check = getattr(backend, "available", None)
    if check is None:
        return True, ""
    try:
        ok = bool(check())
    except Exception as err:  # one broken plug-in must not stop the others
        return False, f"available() raised {type(err).__name__}: {err}"
    return ok, "" if ok else "its available() says no"


@dataclass(frozen=True)
class Entry:
    """One runner of one registered backend, as the crosscheck and benches list them.

    Attributes:
        backend: the backend's registered name.
        runner: the runner; None when the backend could not be imported at all.
        unavailable: why the backend cannot run here ("" when it can).
    """

    backend: str
    runner: Runner | None
    unavailable: str = ""

    @property
    def name(self) -> str:
        return self.backend if self.runner is None else self.runner.name


def runner_entries(
    names: Sequence[str] | None = None, *, check: bool = True, every: bool = False
) -> list[Entry]:
    """Every runner of the backends ``names``, in registry order.

    A name may be a backend's (all its runners) or one runner's. Without names: every
    backend's runners, except a backend that sets ``BY_DEFAULT = False`` (an example, a slow
    simulator), which runs when named (or with ``every=True``). A backend that cannot be
    imported is one entry with no runner, so it is reported, never a crash. With
    ``check=False`` the backends' ``available()`` (which may import their framework) is
    not asked, for listings such as ``--help``.

    Raises:
        ValueError: a name that is neither, listing the names that exist.
    """
    entries: list[Entry] = []
    for backend in list_backends():
        ok, why = backend_available(backend) if check else (True, "")
        try:
            module = get_backend(backend)
        except Exception as err:  # a broken plug-in is reported, never a crash
            entries.append(Entry(backend, None, why or f"cannot import: {err}"))
            continue
        if names is None and not every and not getattr(module, "BY_DEFAULT", True):
            continue
        listed = getattr(module, "runners", None)
        if listed is None:
            entries.append(Entry(backend, None, "it registers no runners"))
            continue
        try:
            runners = list(listed())
        except Exception as err:  # reported like an import failure, never a crash
            entries.append(Entry(backend, None, f"runners() raised {type(err).__name__}: {err}"))
            continue
        entries.extend(Entry(backend, r, "" if ok else why) for r in runners)
    if names is None:
        return entries
    chosen: list[Entry] = []
    unknown = []
    for name in names:
        picked = [e for e in entries if name in (e.backend, e.name)]
        if not picked:
            unknown.append(name)
        chosen.extend(e for e in picked if e not in chosen)
    known = sorted({e.name for e in entries} | {e.backend for e in entries})
    if not names:
        raise ValueError(f"no backend named; known backends and runners: {known}")
    if unknown:
        raise ValueError(f"unknown backends {unknown}; known backends and runners: {known}")
    return chosen


register_backend("reference", "xgrad.reference")
register_backend("torch", "xgrad.torch_backend")
register_backend("jax", "xgrad.jax_backend")
