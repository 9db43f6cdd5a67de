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

__all__ = ["Entry", "Runner", "StepResult", "runner_entries", "runner_names", "step_of"]


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
