"""A forward-only step of the pipeline runtime: torch's ``schedule.eval``.

A validation loss of a pipelined model needs every stage's forward on every microbatch
and nothing else: no backward, no gradient added to ``.grad``, no activation kept. The
runtime's step runs whatever actions its schedule lists, so an evaluation swaps in the
schedule's forwards alone, in each rank's order, with their sends and receives (a
subsequence of an order that cannot deadlock cannot either), and its own plans of the
wire, and swaps the training ones back after. The ranks agree on the schedule again when
they change from one to the other, so a rank that evaluates while its peers train is
refused by name instead of pairing their messages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from xgrad.pipeline import Action, Kind, Schedule, expand
from xgrad.torch_backend.pipeline_call import merge_outputs, step_arguments
from xgrad.torch_backend.pipeline_route import WirePlan

__all__ = ["Evaluation", "Mode", "evaluating", "forward_schedule", "merge_outputs"]

_FORWARD = frozenset({Kind.FORWARD, Kind.SEND_F, Kind.RECV_F})


def forward_schedule(schedule: Schedule) -> Schedule:
    """``schedule``'s forwards and their sends and receives, in each rank's order (an
    overlapped F/B pair keeps its F). Not a schedule :func:`~xgrad.pipeline.validate`
    accepts (it has no backward), only what an evaluation runs."""
    actions = tuple(
        tuple(a for a in expand(acts) if a.kind in _FORWARD) for acts in schedule.actions
    )
    return replace(schedule, actions=actions, name=f"{schedule.name} (forwards)")


class Mode:
    """One way through a step: its schedule, the rank's wire plan, its posted plan (made
    by the first step that needs it) and the schedule's digest (what the ranks agree on)."""

    def __init__(self, schedule: Schedule, rank: int) -> None:
        self.schedule = schedule
        self.route = WirePlan.of(schedule, rank)
        self.plan: Any = None
        self.digest = schedule.digest()


class Evaluation:
    """:meth:`eval`, the part of :class:`~xgrad.torch_backend.pipeline.PipelineRuntime`
    that runs a step's forwards alone (its :meth:`step` does the work)."""

    schedule: Schedule
    rank: int
    _route: WirePlan
    _actions: tuple[Action, ...]
    _plan: Any  # the posted plan of the mode in use (pipeline_posted.PostedPlan)
    _digest: str
    _outputs: dict[int, Any]
    _called: Callable[..., tuple[Any, Any]]  # the runtime's (pipeline_call.StepCall)

    def _start_modes(self) -> None:
        """Training's mode in use (the runtime's schedule, as given); eval's made when
        first used."""
        self._train_mode = Mode(self.schedule, self.rank)
        self._eval_mode: Mode | None = None
        _use(self, self._train_mode)
        self._evaluating = False
        self._outputs: dict[int, Any] = {}
        self._keep_outputs = False  # the last stage's outputs kept (eval, return_outputs)
        self._loss_kwargs: dict[str, Any] | None = None

    def eval(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the forwards alone, on every microbatch, as torch's ``schedule.eval``: for a
        validation loss or predictions. Nothing is added to ``.grad`` and no activation is
        kept; every rank calls it (the ranks agree on the schedule again when they change
        between :meth:`step` and this, so one that trains meanwhile is refused by name).

        torch's ``eval(*args, target=None, losses=None, **kwargs)`` is its ``step`` with the
        backward off, its keywords passed on: ``return_outputs`` (default ``True``) and
        ``loss_kwargs`` too. It runs with gradients on, so its outputs and losses come back
        requiring grad, each holding its microbatch's graph and saved activations until
        dropped; here the forwards run under ``torch.no_grad()`` and give the same values
        without one.

        Args:
            inputs: the whole batch, on the rank of stage 0 (as for :meth:`step`).
            targets: the whole batch's targets on the last stage's rank, or ``None`` for
                no loss.
            target: torch's name for ``targets`` (its ``schedule.eval(x, target=y)``); give
                one of the two (both: a ``TypeError`` naming them).
            losses: on the last stage's rank, a list emptied and filled with each
                microbatch's loss (when ``targets`` are given), as for :meth:`step`.
            return_outputs: ``False`` returns nothing, and keeps no output through the step
                (torch's ``eval(..., return_outputs=False)``).
            loss_kwargs: keywords for ``loss_fn``, as for :meth:`step`.
            **kwargs: keywords for the model, split and given as :meth:`step` gives them.

        Returns:
            On the last stage's rank, its outputs for the whole batch, merged as torch's
            schedules merge them (tensor leaves concatenated along dim 0); else ``None``,
            and everywhere with ``return_outputs=False``.

        Raises:
            xgrad.failure.RankError: as :meth:`step`.
            TypeError: as :meth:`step` (named ``eval()`` here), or ``return_outputs`` not a
                bool.
            ValueError: as :meth:`step`.
        """
        targets = step_arguments("eval", targets, target, losses)
        if not isinstance(return_outputs, bool):
            raise TypeError(f"return_outputs={return_outputs!r} must be a bool")
        with evaluating(self):
            return self._called(inputs, targets, losses, return_outputs, loss_kwargs, kwargs)[1]


@contextlib.contextmanager
def evaluating(runtime: Any) -> Iterator[None]:
    """Run ``runtime``'s next step forward only: its evaluation mode swapped in (made once)
    under ``torch.no_grad()``, the training mode swapped back after, however it ends."""
    if runtime._eval_mode is None:
        runtime._eval_mode = Mode(forward_schedule(runtime._train_mode.schedule), runtime.rank)
    runtime._train_mode.plan = runtime._plan  # kept for the next step (made once)
    _use(runtime, runtime._eval_mode)
    runtime._evaluating = True
    try:
        with torch.no_grad():
            yield
    finally:
        runtime._evaluating = False
        runtime._eval_mode.plan = runtime._plan
        _use(runtime, runtime._train_mode)


def _use(runtime: Any, mode: Mode) -> None:
    runtime.schedule = mode.schedule
    runtime._route = mode.route
    runtime._actions = mode.route.actions
    runtime._plan = mode.plan
    runtime._digest = mode.digest
