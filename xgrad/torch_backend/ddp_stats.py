"""DDP's statistics: the per-iteration timeline and the logging-data dictionary.

PyTorch's DDP keeps the same figures in C++ (``_get_ddp_logging_data``); here they are
computed from the reducer's :class:`~xgrad.reducer.IterationRecord` and the wrapper's
forward time, so they can be read, compared and plotted. :class:`InspectableDDP`, mixed
into the wrapper, is where they are read from it (with the plan in use).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from xgrad.reducer import IterationRecord, Reducer

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


def logging_data(ddp: Any) -> dict[str, Any]:
    """PyTorch's ``_get_ddp_logging_data()`` keys for xgrad's DDP (times in nanoseconds).

    The construction-time keys (module name, flags, bucket cap, dtypes, sizes) and the
    runtime ones PyTorch fills from its reducer (iteration, rebuilt buckets, ready
    order, average times) come from the wrapper and the reducer's records; environment
    keys (``master_addr``, ``gloo_*``) are left out.
    """
    reducer: Reducer = ddp.reducer
    kept = list(ddp.timeline)
    records = list(reducer.records)
    last = records[-1] if records else None
    rebuilt = reducer.has_rebuilt_buckets
    sizes = reducer.bucket_sizes()

    def ns(values: Sequence[float]) -> int:
        return int(_mean(values) * 1e9)

    data: dict[str, Any] = {
        "world_size": reducer.comm.size,
        "rank": reducer.comm.rank,
        "module_name": type(ddp.module).__name__,
        "device_ids": "" if ddp.device_ids is None else ", ".join(map(str, ddp.device_ids)),
        "output_device": -1 if ddp.output_device is None else ddp.output_device,
        "broadcast_buffers": int(ddp.forward_sync_buffers),
        "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in ddp.module.modules())),
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "static_graph": int(ddp.static_graph),
        "backend_name": dist.get_backend(ddp.process_group),
        "is_multi_device_module": 0,
        "dtypes": ", ".join(sorted({_c10_name(p.dtype) for p in reducer.params})),
        "total_parameter_size_bytes": sum(reducer.nbytes),
        "num_parameter_tensors": len(reducer.params),
        # PyTorch logs the construction-time buckets here, the rebuilt ones below.
        "bucket_sizes": ", ".join(map(str, _sizes(reducer, reducer.initial_plan))),
        "iteration": max(reducer.num_iterations - 1, 0),
        "has_rebuilt_buckets": int(rebuilt),
        "unused_parameter_size": sum(reducer.nbytes[i] for i in last.unused) if last else 0,
        "num_buckets_reduced": len(sizes),
        "prev_iteration_grad_ready_order_indices": (
            ", ".join(map(str, last.ready_order)) if last else ""
        ),
        "avg_forward_compute_time": ns([t.forward for t in kept]),
        "avg_backward_compute_time": ns([t.backward_compute for t in kept]),
        "avg_backward_comm_time": ns([t.communication for t in kept]),
        "avg_backward_compute_comm_overlap_time": ns([t.overlap for t in kept]),
    }
    if rebuilt:
        data["rebuilt_bucket_sizes"] = ", ".join(map(str, sizes))
        data["rebuilt_per_bucket_param_indices"] = ", ".join(
            " ".join(map(str, b)) for b in reducer.plan.buckets
        )
    return data


#: PyTorch's logging names of dtypes (c10's type names), for the ones parameters have.
_C10_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
    torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
}


def _c10_name(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _sizes(reducer: Reducer, plan: Any) -> list[int]:
    """Bytes per bucket of ``plan``, in launch order."""
    return [sum(reducer.nbytes[i] for i in b) for b in plan.buckets]


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
        """PyTorch's logging dictionary, from xgrad's records (nanoseconds)."""
        return logging_data(self)
