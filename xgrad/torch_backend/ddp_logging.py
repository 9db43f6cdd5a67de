"""PyTorch's ``_get_ddp_logging_data()`` for xgrad's DDP, sampled as PyTorch's logger samples.

PyTorch's C++ logger keeps three kinds of keys, and xgrad keeps them alike:

- **construction** (module name, flags, bucket cap, dtypes, sizes), set once;
- **environment** (``master_addr``, ``master_port``, ``torch_distributed_debug``,
  ``cuda_visible_devices``; ``gloo_*`` on gloo, ``nccl_*`` on NCCL; ``"N/A"`` where
  unset), read at construction;
- **runtime** (``iteration``, rebuilt buckets, ready order, unused size, the timings),
  refreshed only at a *sampled* iteration: at the start of the forward pass of
  iteration n (n synchronised backward passes done), when n > 0 and n <= 10 or n is a
  multiple of the sample rate (``_set_ddp_runtime_logging_sample_rate``, 100 by
  default), before that forward pass rebuilds the buckets. The timings are the previous
  iteration's (``forward_compute_time``, ``backward_compute_time``,
  ``backward_comm_time``, ``backward_compute_comm_overlap_time``, in ns; the
  ``*_start``/``*_end`` moments in ns since the epoch), and ``avg_*`` their mean over the
  sampled iterations. Between samples the keys keep their values, so a script (or
  PyTorch's own test) reading them after step ``idx`` sees ``iteration == idx`` exactly
  at the sampled steps.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xgrad.reducer import Reducer

__all__ = ["RuntimeLog", "environment", "logging_data", "sampled"]

#: PyTorch's logger: every iteration up to this one is sampled.
ALWAYS_SAMPLED = 10

_TIMES = (
    ("forward_compute_time", "forward"),
    ("backward_compute_time", "backward_compute"),
    ("backward_comm_time", "communication"),
    ("backward_compute_comm_overlap_time", "overlap"),
)


def sampled(iteration: int, rate: int) -> bool:
    """Whether PyTorch's logger refreshes its runtime keys at ``iteration``'s forward pass."""
    return iteration > 0 and (iteration <= ALWAYS_SAMPLED or iteration % rate == 0)


def _env(name: str) -> str:
    return os.environ.get(name, "N/A")


def environment(group: Any) -> dict[str, Any]:
    """The environment keys PyTorch's logger reads at construction, for ``group``'s backend."""
    keys: dict[str, Any] = {
        "master_port": _env("MASTER_PORT"),
        "master_addr": _env("MASTER_ADDR"),
        "torch_distributed_debug": _env("TORCH_DISTRIBUTED_DEBUG"),
        "cuda_visible_devices": _env("CUDA_VISIBLE_DEVICES"),
    }
    backend = dist.get_backend(group)
    if backend == "gloo":
        keys["gloo_socket_ifname"] = _env("GLOO_SOCKET_IFNAME")
        keys["gloo_device_transport"] = _env("GLOO_DEVICE_TRANSPORT")
        threads = _gloo_threads(group)
        if threads is not None:
            keys["gloo_num_threads"] = threads
    elif backend == "nccl":
        for name in ("socket_ifname", "blocking_wait", "async_error_handling", "debug"):
            keys[f"nccl_{name}"] = _env(f"NCCL_{name.upper()}")
        keys["nccl_nthreads"] = _env("NCCL_NTHREADS")
        keys["nccl_ib_timeout"] = _env("NCCL_IB_TIMEOUT")
    return keys


def _gloo_threads(group: Any) -> int | None:
    """The gloo backend's thread count (its options'; private to c10d, so maybe absent)."""
    try:
        pg: Any = group if group is not None else dist.group.WORLD
        return int(pg._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def _epoch_offset_ns() -> int:
    """Add to a ``time.perf_counter`` moment in ns to get ns since the epoch (PyTorch's
    host-side times)."""
    return time.time_ns() - int(time.perf_counter() * 1e9)


class RuntimeLog:
    """The runtime keys of one DDP, refreshed at sampled forward passes (:meth:`sample`)."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}
        self._sums: dict[str, int] = {}
        self._samples = 0

    def error(self, exc: BaseException) -> None:
        """An error the DDP raised on this rank: PyTorch's logger keeps the last one
        (``has_error``, ``error``), for a job's post-mortem and its own tests."""
        self.keys["has_error"] = 1
        self.keys["error"] = str(exc)

    def sample(self, ddp: Any, rate: int) -> None:
        """At the start of a synchronised forward pass, before any rebuild: refresh the
        keys if PyTorch's logger would sample this iteration (see the module docstring)."""
        reducer: Reducer = ddp.reducer
        n = reducer.num_iterations
        if not sampled(n, rate):
            return
        keys = self.keys
        last = reducer.records[-1] if reducer.records else None
        keys["iteration"] = n
        keys["has_rebuilt_buckets"] = int(reducer.has_rebuilt_buckets)
        keys["num_buckets_reduced"] = len(reducer.bucket_sizes())
        keys["unused_parameter_size"] = sum(reducer.nbytes[i] for i in last.unused) if last else 0
        if reducer.has_rebuilt_buckets:
            keys["rebuilt_bucket_sizes"] = ", ".join(map(str, reducer.bucket_sizes()))
            keys["rebuilt_per_bucket_param_indices"] = ", ".join(
                " ".join(map(str, b)) for b in reducer.plan.buckets
            )
        if last is None:
            return
        keys["prev_iteration_grad_ready_order_indices"] = ", ".join(map(str, last.ready_order))
        timeline = ddp.timeline
        times = timeline[-1] if timeline and timeline[-1].iteration == last.iteration else None
        if times is None:
            return
        self._samples += 1
        for key, field in _TIMES:
            value = int(getattr(times, field) * 1e9)
            keys[key] = value
            self._sums[key] = self._sums.get(key, 0) + value
            keys[f"avg_{key}"] = self._sums[key] // self._samples
        offset = _epoch_offset_ns()  # read once: the moments stay in order

        def epoch_ns(perf_seconds: float) -> int:
            return offset + int(perf_seconds * 1e9)

        keys["forward_compute_time_start"] = epoch_ns(times.forward_start)
        keys["backward_compute_time_start"] = epoch_ns(last.backward_start)
        keys["backward_compute_time_end"] = epoch_ns(
            last.ready_times[-1] if last.ready_times else last.backward_start
        )
        if last.launch_times:
            keys["backward_comm_time_start"] = epoch_ns(min(last.launch_times))
            keys["backward_comm_time_end"] = epoch_ns(max(last.finish_times))


def logging_data(ddp: Any) -> dict[str, Any]:
    """PyTorch's ``_get_ddp_logging_data()`` for xgrad's DDP (see the module docstring)."""
    reducer: Reducer = ddp.reducer
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
        "backend_name": dist.get_backend(ddp.process_group),
        "is_multi_device_module": 0,
        "dtypes": ", ".join(sorted({_c10_name(p.dtype) for p in reducer.params})),
        "total_parameter_size_bytes": sum(reducer.nbytes),
        "num_parameter_tensors": len(reducer.params),
        # PyTorch logs the construction-time buckets here, the rebuilt ones at a sample.
        "bucket_sizes": ", ".join(map(str, _sizes(reducer, reducer.initial_plan))),
        "iteration": 0,
    }
    if ddp.static_graph:  # PyTorch sets it when the graph is made static, else leaves it out
        data["static_graph"] = 1
    if ddp._join_uneven_inputs:  # set by a join hook, as PyTorch's logger sets it
        data["join_uneven_inputs"] = 1
    data.update(ddp._logging_environment)
    data.update(ddp._runtime_log.keys)
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
