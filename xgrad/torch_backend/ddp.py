"""``DistributedDataParallel``: PyTorch's DDP, driven by xgrad's plan and reducer.

A drop-in for ``torch.nn.parallel.DistributedDataParallel``: the same constructor
arguments and defaults, ``no_sync()``, ``register_comm_hook`` with PyTorch's own hooks.
The bucketing and reduction are xgrad's backend-neutral :class:`~xgrad.reducer.Reducer`
fed by per-parameter autograd hooks, so what PyTorch keeps inside C++ can be looked at:
the plan, the order in which gradients became ready, the per-iteration timeline.

One training step, as PyTorch's DDP does it::

    forward    rebuild buckets once (from the last ready order; rank 0's plan wins)
               sync buffers from rank 0, run the module,
               walk the grad_fn graph for unused parameters (find_unused_parameters)
               reducer.prepare_for_backward(unused)
    backward   post-accumulate hook of parameter i -> reducer.mark_ready(i, grad)
               (the first one also queues finalize on the autograd engine and marks the
               unused parameters ready); a full bucket is launched in bucket order
    end        engine's final callback: reducer.finalize() waits for every bucket and
               writes the averaged gradients to .grad (or makes .grad the bucket view)
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from xgrad.backend import Comm, Work
from xgrad.buckets import (
    BucketPlan,
    ddp_bucket_caps,
    ddp_initial_plan,
)
from xgrad.reducer import GradBucket, Hook, Reducer
from xgrad.torch_backend.autograd_graph import find_unused_parameters
from xgrad.torch_backend.comm import DEFAULT_TIMEOUT, FutureWork, TorchComm
from xgrad.torch_backend.ops import TorchArrayOps
from xgrad.torch_backend.sync import broadcast_state, verify_params_across_ranks

__all__ = ["DistributedDataParallel", "IterationTimes"]

_MIB = 1024 * 1024

#: per-iteration timings kept for statistics (the newest).
_TIMINGS_KEPT = 64


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


def _produces_sparse_gradient(module: nn.Module) -> bool:
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return bool(module.sparse)
    return False


class DistributedDataParallel(nn.Module):
    """Data parallelism over a process group, with PyTorch DDP's arguments and behaviour.

    Args:
        module: the module to replicate (its parameters on one device type).
        device_ids: ``None`` for CPU modules; ``[i]`` for a module on CUDA device ``i``
            (inputs are moved there).
        output_device: kept for compatibility; outputs stay where the module puts them.
        dim: kept for compatibility (single-device modules are not scattered).
        broadcast_buffers: broadcast rank 0's buffers at construction and before every
            synchronised forward pass (``None`` means ``True``, as in PyTorch).
        init_sync: check the models agree across ranks and copy rank 0's state.
        process_group: the group to reduce over (default: the default group).
        bucket_cap_mb: bucket cap in MiB (default 25, with a 1 MiB first bucket).
        find_unused_parameters: walk the graph from the outputs after every forward
            pass and mark the parameters it does not reach ready.
        check_reduction: deprecated in PyTorch and ignored there; ignored here.
        gradient_as_bucket_view: make each ``.grad`` a view into its bucket (no copy back).
        static_graph: the set of used parameters never changes: found in the first
            iteration, whose reduction is delayed to its end; then reused.
        first_bucket_cap_mb: cap of the first bucket (xgrad extra).
        plan: an explicit :class:`~xgrad.buckets.BucketPlan` over the parameter order of
            ``named_parameters`` (those that require grad), used as given: no rebuild.
        comm_hook: a backend-neutral hook factory such as ``xgrad.hooks.fp16_compress_hook``,
            called with this module's :class:`~xgrad.torch_backend.comm.TorchComm`.
        timeout: seconds any wait on a reduction may block before it raises.

    Example:
        >>> ddp = DistributedDataParallel(model)  # doctest: +SKIP
        >>> ddp(x).sum().backward()               # .grad now averaged over ranks
        >>> print(ddp.plan.table())
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = True,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        first_bucket_cap_mb: float | None = None,
        plan: BucketPlan | None = None,
        comm_hook: Callable[[Comm], Hook] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.comm = TorchComm(process_group, timeout=timeout)
        self.dim = dim
        self.broadcast_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.timeout = timeout

        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.parameter_names, self._params, sparse = self._reduced_parameters(module, ignore)
        if not self._params:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any "
                "parameter that requires a gradient."
            )
        if any(sparse):
            names = [n for n, s in zip(self.parameter_names, sparse, strict=True) if s]
            raise ValueError(
                f"sparse gradients are not supported by xgrad's DDP (parameters {names} come "
                "from an Embedding with sparse=True); use sparse=False"
            )
        self._set_devices(device_ids, output_device)
        self._buffers_list = [b for name, b in module.named_buffers() if name not in ignore]

        if init_sync:
            verify_params_across_ranks(self.comm, self.parameter_names, self._params)
            broadcast_state(self.comm, module, buffers=self.broadcast_buffers, ignore=ignore)

        ops = TorchArrayOps()
        nbytes = [ops.nbytes(p) for p in self._params]
        keys = [ops.key(p) for p in self._params]
        first, cap = ddp_bucket_caps(
            None if bucket_cap_mb is None else int(bucket_cap_mb * _MIB),
            None if first_bucket_cap_mb is None else int(first_bucket_cap_mb * _MIB),
        )
        self.plan_is_explicit = plan is not None
        if plan is None:
            plan = ddp_initial_plan(
                nbytes,
                keys=keys,
                bucket_cap_bytes=cap,
                first_bucket_cap_bytes=first,
                find_unused_parameters=find_unused_parameters,
                static_graph=static_graph,
            )
        elif plan.num_params != len(self._params):
            raise ValueError(
                f"plan covers {plan.num_params} parameters but the module has "
                f"{len(self._params)} that require grad"
            )
        self.initial_plan = plan
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        self.reducer = Reducer(
            self._params,
            plan,
            self.comm,
            ops,
            set_grad=self._set_grad,
            names=self.parameter_names,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            rebuild_limits=(first, cap),
            nbytes=nbytes,
            keys=keys,
        )
        if self.plan_is_explicit:
            self.reducer.has_rebuilt_buckets = True  # a plan given is used as given
        self._hook_registered = False
        self._sync_pending = False
        self._copy_dst: list[torch.Tensor] = []
        self._copy_src: list[torch.Tensor] = []
        if comm_hook is not None:
            self.register_hook(comm_hook(self.comm))
        self.timeline: deque[IterationTimes] = deque(maxlen=_TIMINGS_KEPT)
        self._forward_seconds = 0.0
        self._backward_started = 0.0
        if gradient_as_bucket_view:
            self._alias_grads_to_buckets()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self._params)
        ]

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _reduced_parameters(
        module: nn.Module, ignore: set[str]
    ) -> tuple[list[str], list[nn.Parameter], list[bool]]:
        """DDP's parameter order: by module, requiring grad, not ignored, shared ones once."""
        names: list[str] = []
        params: list[nn.Parameter] = []
        sparse: list[bool] = []
        seen: set[int] = set()
        for module_name, sub in module.named_modules():
            for param_name, p in sub.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                if not p.requires_grad or name in ignore or id(p) in seen:
                    continue
                seen.add(id(p))
                names.append(name)
                params.append(p)
                sparse.append(_produces_sparse_gradient(sub))
        return names, params, sparse

    def _set_devices(
        self,
        device_ids: Sequence[int | torch.device] | None,
        output_device: int | torch.device | None,
    ) -> None:
        device_types = {p.device.type for p in self._params}
        if len(device_types) != 1:
            raise ValueError(
                "DistributedDataParallel's input module must be on the same type of devices, "
                f"but input module parameters locate in {device_types}."
            )
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(
                f"device_ids can only be None or contain a single element, got {device_ids!r}"
            )
        self.device_type = device_types.pop()
        if not device_ids or self.device_type == "cpu":
            if device_ids or output_device is not None:
                raise ValueError(
                    "DistributedDataParallel device_ids and output_device arguments only work "
                    f"with single-device GPU modules, but got device_ids {device_ids}, "
                    f"output_device {output_device} and a {self.device_type} module."
                )
            self.device_ids: list[int] | None = None
            self.output_device: int | None = None
            return
        self.device_ids = [_device_index(d) for d in device_ids]
        self.output_device = (
            self.device_ids[0] if output_device is None else _device_index(output_device)
        )

    # ------------------------------------------------------------------ gradients

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        reducer = self.reducer
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]

        def hook(param: torch.Tensor) -> None:
            if self._sync_pending:
                # First gradient of a synchronised backward pass: end it with finalize.
                self._sync_pending = False
                self._backward_started = time.perf_counter()
                engine.queue_callback(self._finalize)
            reducer.mark_ready(index, param.grad)

        return hook

    def _finalize(self) -> None:
        try:
            self.reducer.finalize()
            if self._copy_dst:
                # One fused copy for every gradient instead of one call per parameter.
                torch._foreach_copy_(self._copy_dst, self._copy_src)
        finally:
            self._copy_dst.clear()
            self._copy_src.clear()
        end = time.perf_counter()
        record = self.reducer.records[-1]
        self.timeline.append(
            IterationTimes(
                iteration=record.iteration,
                forward=self._forward_seconds,
                backward=end - self._backward_started,
                backward_compute=record.compute_seconds,
                communication=record.communication_seconds,
                overlap=record.overlap_seconds,
            )
        )

    def _set_grad(self, index: int, view: torch.Tensor) -> None:
        p = self._params[index]
        grad = p.grad
        if self.gradient_as_bucket_view:
            if grad is None or grad.data_ptr() != view.data_ptr():
                p.grad = view
        elif grad is None:
            p.grad = view.clone()
        else:
            self._copy_dst.append(grad)
            self._copy_src.append(view)

    def _alias_grads_to_buckets(self) -> None:
        """Make existing gradients views into the (new) buckets, keeping their values."""
        with torch.no_grad():
            for p, view in zip(self._params, self.reducer.bucket_views(), strict=True):
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view

    # ------------------------------------------------------------------ forward

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and self.reducer.rebuild_buckets() and self.gradient_as_bucket_view:
            self._alias_grads_to_buckets()
        if self.require_forward_param_sync and self.broadcast_buffers and self._buffers_list:
            self._sync_buffers()
        if self.device_ids:
            device = torch.device(self.device_type, self.device_ids[0])
            inputs, kwargs = tree_map(
                lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, (inputs, kwargs)
            )
        output = self.module(*inputs, **kwargs)
        if grad_enabled and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            unused: Sequence[int] = ()
            if self.find_unused_parameters and not self.static_graph:
                unused = find_unused_parameters(output, self._param_index, len(self._params))
            self.reducer.prepare_for_backward(unused)
            self._sync_pending = True
            self._forward_seconds = time.perf_counter() - start
        else:
            self.require_forward_param_sync = False
        return output

    def _sync_buffers(self) -> None:
        if self.comm.size > 1:
            with torch.no_grad():
                self.comm.broadcast_tensors(self._buffers_list, src=0)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first synchronised pass after reduces them all.

        The forward pass must run inside the context, as with PyTorch's DDP.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # ------------------------------------------------------------------ hooks

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Register a PyTorch communication hook, ``hook(state, bucket) -> Future``.

        PyTorch's own hooks (``default_hooks.allreduce_hook``, ``fp16_compress_hook``,
        ``bf16_compress_hook``, ``powerSGD_hook.powerSGD_hook``) run unchanged: the
        bucket they get has ``GradBucket``'s methods. The returned future is waited on
        with this module's timeout. Call once, before the first forward pass.
        """
        if not callable(hook):
            raise TypeError(f"Communication hook must be callable, got {hook!r}")
        name = getattr(hook, "__name__", type(hook).__name__)
        timeout = self.timeout

        def run(bucket: GradBucket) -> Work:
            future = hook(state, bucket)
            if not isinstance(future, torch._C.Future):
                raise TypeError(
                    f"communication hook {name} returned {type(future).__name__}, "
                    "expected torch.futures.Future[torch.Tensor]"
                )
            return FutureWork(future, timeout, name=f"comm hook {name} on bucket {bucket.index()}")

        self.register_hook(run)
        # On gloo a future's callbacks run on gloo's threads as collectives complete, in an
        # order that differs between ranks; PowerSGD issues collectives from such callbacks,
        # so buckets overlapping would mismatch collectives across ranks (PyTorch's DDP
        # hangs there). NCCL runs callbacks in stream order, so it keeps the overlap.
        self.reducer.serial_hooks = dist.get_backend(self.comm.group) != "nccl"

    def register_hook(self, hook: Hook) -> None:
        """Register a backend-neutral hook with its state bound (``bucket -> Work``).

        Example: ``ddp.register_hook(xgrad.hooks.fp16_compress_hook(ddp.comm))``.
        """
        if self._hook_registered:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        if self.reducer.num_iterations or self._sync_pending:
            raise RuntimeError(
                "register_comm_hook must be called before the first forward/backward pass "
                f"(rank {self.comm.rank})"
            )
        self.reducer.hook = hook
        self._hook_registered = True

    # ------------------------------------------------------------------ introspection

    @property
    def plan(self) -> BucketPlan:
        """The bucket plan in use now (changes once, when the buckets are rebuilt)."""
        return self.reducer.plan

    def statistics(self) -> dict[str, Any]:
        """What PyTorch's DDP logging data says, in seconds and names.

        Keys: ``world_size``, ``rank``, ``num_parameters``, ``initial_plan``, ``plan``
        (JSON), ``has_rebuilt_buckets``, ``bucket_sizes`` (bytes, launch order),
        ``ready_order`` (parameter names, last synchronised iteration) and
        ``ready_order_indices`` (the same as indices), ``iterations``, ``timeline``
        (per kept iteration: :class:`IterationTimes` as a dict), and the averages over
        the kept iterations ``avg_forward_time``, ``avg_backward_time``,
        ``avg_backward_compute_time``, ``avg_backward_comm_time``,
        ``avg_backward_compute_comm_overlap_time``.
        """
        records = list(self.reducer.records)
        last = records[-1] if records else None
        timeline = list(self.timeline)
        return {
            "world_size": self.comm.size,
            "rank": self.comm.rank,
            "num_parameters": len(self._params),
            "initial_plan": self.initial_plan.to_json(),
            "plan": self.plan.to_json(),
            "has_rebuilt_buckets": self.reducer.has_rebuilt_buckets and not self.plan_is_explicit,
            "bucket_sizes": self.reducer.bucket_sizes(),
            "ready_order": [self.parameter_names[i] for i in last.ready_order] if last else [],
            "ready_order_indices": list(last.ready_order) if last else [],
            "iterations": self.reducer.num_iterations,
            "timeline": [dataclasses.asdict(t) for t in timeline],
            "avg_forward_time": _mean([t.forward for t in timeline]),
            "avg_backward_time": _mean([t.backward for t in timeline]),
            "avg_backward_compute_time": _mean([t.backward_compute for t in timeline]),
            "avg_backward_comm_time": _mean([t.communication for t in timeline]),
            "avg_backward_compute_comm_overlap_time": _mean([t.overlap for t in timeline]),
        }


def _device_index(device: int | torch.device) -> int:
    """``3``, ``torch.device("cuda", 3)`` and ``torch.device("cuda:3")`` all give 3."""
    if isinstance(device, torch.device):
        return 0 if device.index is None else device.index
    return int(device)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
