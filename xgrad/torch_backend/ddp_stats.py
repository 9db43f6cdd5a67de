"""DDP's statistics: the per-iteration timeline and the logging-data dictionary.

PyTorch's DDP keeps the same figures in C++ (``_get_ddp_logging_data``); here they are
computed from the reducer's :class:`~xgrad.reducer.IterationRecord` and the wrapper's
forward time, so they can be read, compared and plotted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from xgrad.buckets import BucketPlan
from xgrad.reducer import IterationRecord, Reducer

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
    """

    iteration: int
    forward: float
    backward: float
    backward_compute: float
    communication: float
    overlap: float

    @classmethod
    def of(cls, record: IterationRecord, forward: float, backward: float) -> IterationTimes:
        """The timeline of ``record``, with the times only the wrapper measures."""
        return cls(
            iteration=record.iteration,
            forward=forward,
            backward=backward,
            backward_compute=record.compute_seconds,
            communication=record.communication_seconds,
            overlap=record.overlap_seconds,
        )


def statistics(
    *,
    reducer: Reducer,
    names: Sequence[str],
    initial_plan: BucketPlan,
    plan_is_explicit: bool,
    timeline: Iterable[IterationTimes],
) -> dict[str, Any]:
    """The statistics dictionary of :meth:`DistributedDataParallel.statistics`."""
    records = list(reducer.records)
    last = records[-1] if records else None
    kept = list(timeline)
    return {
        "world_size": reducer.comm.size,
        "rank": reducer.comm.rank,
        "num_parameters": len(reducer.params),
        "initial_plan": initial_plan.to_json(),
        "plan": reducer.plan.to_json(),
        "has_rebuilt_buckets": reducer.has_rebuilt_buckets and not plan_is_explicit,
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
