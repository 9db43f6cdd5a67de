"""The crosscheck's runners: every runner of every registered backend, none named here.

A backend (built in, registered, or from the ``xgrad.backends`` entry points) takes part
in ``xgrad crosscheck`` by listing :class:`~xgrad.backend.Runner` objects; this module
turns a crosscheck's inputs into the :class:`~xgrad.backend.Step` they all get.
"""

from __future__ import annotations

from collections.abc import Sequence

from xgrad.backend import Entry, Runner, Step, StepResult, runner_entries
from xgrad.crosscheck.case import Inputs
from xgrad.crosscheck.truth import powersgd_config, torch_sampler

__all__ = [
    "Entry",
    "Runner",
    "StepResult",
    "WorldSizeError",
    "check_world_size",
    "runner_entries",
    "runner_names",
    "step_of",
]


class WorldSizeError(ValueError):
    """A chosen runner cannot run this many ranks; its name, limit and why are attributes."""

    def __init__(self, world_size: int, runner: str, limit: int, why: str) -> None:
        self.world_size, self.runner, self.limit, self.why = world_size, runner, limit, why
        super().__init__(
            f"world_size={world_size} is more than runner {runner} takes: at most {limit} "
            f"({why}); choose fewer ranks, or leave {runner} out of the backends"
        )


def check_world_size(entries: Sequence[Entry], world_size: int) -> None:
    """Refuse, before any input is made, a world larger than a chosen runner can run.

    A runner declares its limit as an optional ``max_world_size`` attribute (and
    ``max_world_size_why``); a runner without one is not limited here.

    Raises:
        WorldSizeError: for the first runner whose limit ``world_size`` exceeds.
    """
    for entry in entries:
        limit = getattr(entry.runner, "max_world_size", None)
        if isinstance(limit, int) and world_size > limit:
            why = getattr(entry.runner, "max_world_size_why", "") or "its declared limit"
            raise WorldSizeError(world_size, entry.name, limit, why)


def step_of(inputs: Inputs) -> Step:
    """The step every runner of a crosscheck gets: the case's weights, batch and plan."""
    case = inputs.case
    return Step(
        model=case.model,
        weights=inputs.weights,
        x=inputs.x,
        y=inputs.y,
        world_size=case.world_size,
        plan=inputs.plan,
        hook=case.hook,
        steps=case.steps,
        timeout=case.timeout,
        powersgd=powersgd_config(case.stateful),
        sampler=torch_sampler(),
        processes=case.jax_processes,
        device=case.device,
    )


def runner_names(entries: Sequence[Entry] | None = None) -> list[str]:
    """The names of every runner (or of a backend that could not list its runners)."""
    return [e.name for e in (runner_entries(check=False) if entries is None else entries)]
