"""DDP's statistics: the per-iteration timeline and xgrad's statistics dictionary.

PyTorch's DDP keeps the same figures in C++ (``_get_ddp_logging_data``, sampled: see
:mod:`.ddp_logging`); here every iteration's are computed from the reducer's
:class:`~xgrad.reducer.IterationRecord` and the wrapper's forward time, so they can be
read, compared and plotted. :class:`InspectableDDP`, mixed into the wrapper, is where
they are read from it (with the plan in use).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from xgrad.reducer import IterationRecord, Reducer
from xgrad.torch_backend.ddp_logging import logging_data

if TYPE_CHECKING:
    from collections import deque

    from xgrad.buckets import BucketPlan
    from xgrad.torch_backend.ddp_hooks import GradientHooks

#: per-iteration timings kept for statistics (the newest).
TIMINGS_KEPT = 64


@dataclasses.dataclass(frozen=True)
class IterationTimes:
    """One synchronised iteration's timeline, in seconds (PyTorch's DDP logs the same).

    Attributes:
        iteration: 0-based count of synchronised backward passes.
        forward: the forward pass, through DDP (bucket rebuild and buffer sync included).
        backward: from the first gradient hook to the gradients written back.
        backward_compute: from the first gradient hook to the last gradient ready.
        communication: from the first bucket launched to the last one finished.
        overlap: communication while gradients were still being computed.
        forward_start: when the forward pass began (``time.perf_counter``, as the
            reducer's records).
    """

    iteration: int
    forward: float
    backward: float
    backward_compute: float
    communication: float
    overlap: float
    forward_start: float = 0.0

    @classmethod
    def of(
        cls, record: IterationRecord, forward: float, backward: float, forward_start: float = 0.0
    ) -> IterationTimes:
        """The timeline of ``record``, with the times only the wrapper measures."""
        return cls(
            iteration=record.iteration,
            forward=forward,
            backward=backward,
            backward_compute=record.compute_seconds,
            communication=record.communication_seconds,
            overlap=record.overlap_seconds,
            forward_start=forward_start,
        )


def statistics(
    *, reducer: Reducer, names: Sequence[str], timeline: Iterable[IterationTimes]
) -> dict[str, Any]:
    """The statistics dictionary of :meth:`DistributedDataParallel.statistics`.

    Keys: ``world_size``, ``rank``, ``num_parameters``, ``initial_plan``, ``plan``
    (JSON), ``has_rebuilt_buckets``, ``bucket_sizes`` (bytes, launch order),
    ``ready_order`` (parameter names, last synchronised iteration) and
    ``ready_order_indices`` (the same as indices), ``iterations``, ``timeline``
    (per kept iteration: :class:`IterationTimes` as a dict), and the averages over
    the kept iterations ``avg_forward_time``, ``avg_backward_time``,
    ``avg_backward_compute_time``, ``avg_backward_comm_time``,
    ``avg_backward_compute_comm_overlap_time``.
    """
    records = list(reducer.records)
    last = records[-1] if records else None
    kept = list(timeline)
    return {
        "world_size": reducer.comm.size,
        "rank": reducer.comm.rank,
        "num_parameters": len(reducer.params),
        "initial_plan": reducer.initial_plan.to_json(),
        "plan": reducer.plan.to_json(),
        "has_rebuilt_buckets": reducer.has_rebuilt_buckets,
        "bucket_sizes": reducer.bucket_sizes(),
        "ready_order": [names[i] for i in last.ready_order] if last else [],
        "ready_order_indices": list(last.ready_order) if last else [],
        "iterations": reducer.num_iterations,
        "timeline": [dataclasses.asdict(t) for t in kept],
        "avg_forward_time": _mean([t.forward for t in kept]),
        "avg_backward_time": _mean([t.backward for t in kept]),
        "avg_backward_compute_time": _mean([t.backward_compute for t in kept]),
        "avg_backward_comm_time": _mean([t.communication for t in kept]),
        "avg_backward_compute_comm_overlap_time": _mean([t.overlap for t in kept]),
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class InspectableDDP:
    """Mixed into the DDP: what PyTorch keeps inside C++, read from xgrad's reducer."""

    reducer: Reducer
    parameter_names: list[str]
    _grad_hooks: GradientHooks

    @property
    def plan(self) -> BucketPlan:
        """The bucket plan in use now (changes once, when the buckets are rebuilt)."""
        return self.reducer.plan

    @property
    def timeline(self) -> deque[IterationTimes]:
        """The kept iterations' timelines, oldest first."""
        return self._grad_hooks.timeline

    def statistics(self) -> dict[str, Any]:
        """PyTorch's logging data in seconds and names (see ``ddp_stats.statistics``)."""
        return statistics(reducer=self.reducer, names=self.parameter_names, timeline=self.timeline)

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """PyTorch's logging dictionary, sampled as PyTorch samples it (``ddp_logging``)."""
        return logging_data(self)
