"""What a backend is: the protocols the core and the crosscheck hold it to.

:class:`Comm` (with :class:`Work`, an in-flight collective) is all the reducer and the
hooks need of a process group; a :class:`Runner` runs a data-parallel :class:`Step` and
says what it cannot run (:func:`unsupported_by_declaration` reads its declared hooks,
dtypes and devices); :class:`Truth` is a backend's float64 reference gradients; and
:class:`Backend` is the module (or object) the registry returns. Kept apart from the
registry, :mod:`xgrad.backend`, which finds backends by name and re-exports every name
here: a backend implements these, and the core's reducer and hooks use :class:`Comm`
and :class:`Work`, without the registry's lookups.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from xgrad.step import Step, StepResult

if TYPE_CHECKING:
    from xgrad.reducer import ArrayOps

__all__ = [
    "Backend",
    "Comm",
    "Runner",
    "Truth",
    "Work",
    "unsupported_by_declaration",
]


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


@runtime_checkable
class Runner(Protocol):
    """One way a backend runs a :class:`Step` (one column of ``xgrad crosscheck``).

    Attributes:
        name: unique over all backends, e.g. ``"torch-xgrad"``.
        description: one line for reports.
        hooks: the hook names it runs (``None``, no hook, always runs).
        dtypes: the model dtypes it runs.
    """

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def hooks(self) -> tuple[str, ...]: ...

    @property
    def dtypes(self) -> tuple[str, ...]: ...

    def unsupported(self, step: Step) -> str | None:
        """Why ``step`` cannot run here (hook, dtype, world size, model), or None."""
        ...

    def run(self, step: Step) -> StepResult:
        """Run ``step`` and return the reduced gradients and the plan really used."""
        ...


@dataclass(frozen=True)
class Truth:
    """A backend's single-process, full-batch float64 gradients: what runners are judged by.

    Attributes:
        grads: ``grads(model, weights, x, y) -> {name: float64 gradient}``; the weights
            and batch are converted exactly to float64 first.
        covers: whether it can differentiate a model (by name).
        description: one line for reports (``"torch float64, one process, full batch"``).
        independent: computed by a framework's own autograd rather than xgrad's engine,
            so it checks xgrad's engine too; preferred over one that is not.
    """

    grads: Callable[[str, Mapping[str, np.ndarray], np.ndarray, np.ndarray], dict[str, np.ndarray]]
    covers: Callable[[str], bool]
    description: str
    independent: bool


def unsupported_by_declaration(runner: Runner, step: Step) -> str | None:
    """The reasons a runner's declared ``hooks`` and ``dtypes`` give against ``step``."""
    if step.hook is not None and step.hook not in runner.hooks:
        runs = ", ".join(runner.hooks) or "no hook"
        return f"{runner.name} runs hooks {runs} only, not {step.hook!r}"
    if step.dtype not in runner.dtypes:
        return f"{runner.name} runs {', '.join(runner.dtypes)} only, not {step.dtype}"
    devices = getattr(runner, "devices", ("cpu",))
    if step.device not in devices:
        return f"{runner.name} runs on {', '.join(devices)} only, not {step.device}"
    return None


class Backend(Protocol):
    """What :func:`get_backend` returns: a module (or object) that can run steps.

    A backend package is usually the module itself, with these names at module level.

    Attributes:
        name: the registered name (``"torch"``).
        run_ranks: ``run_ranks(fn, world_size, *, timeout) -> [fn(comm) per rank]``, the
            backend's process group as a :class:`Comm` (None where it has none: a backend
            that reduces inside a compiled function, as JAX does).
    """

    name: str
    run_ranks: Callable[..., list[Any]] | None
    #: optional: ``xgrad bench`` targets it adds, target -> module (``HELP``,
    #: ``add_arguments``, ``run``), imported only when that target runs.
    BENCHES: Mapping[str, str]
    #: optional, default True: whether its runners take part when no backend is named.
    BY_DEFAULT: bool

    def available(self) -> bool:
        """Whether it can run here (its framework imports); cheap, imports nothing heavy."""
        ...

    def runners(self) -> Sequence[Runner]:
        """Its ways to run a :class:`Step`; building them imports nothing heavy."""
        ...

    def array_ops(self) -> tuple[ArrayOps, Callable[[np.ndarray], Any]] | None:
        """The reducer's array operations and ``numpy -> native array``, or None."""
        ...

    def truth(self) -> Truth | None:
        """Its float64 single-process gradients (:class:`Truth`), or None."""
        ...
