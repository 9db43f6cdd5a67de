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

The pieces: parameter discovery and device checks in ``ddp_params``, the autograd hook
adapter in ``ddp_hooks``, the timeline and statistics in ``ddp_stats``; this module is the
``nn.Module`` wrapper that ties them to the reducer.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from xgrad.backend import Comm
from xgrad.buckets import (
    BucketPlan,
    ddp_bucket_caps,
    ddp_initial_plan,
)
from xgrad.reducer import Hook, Reducer
from xgrad.torch_backend.autograd_graph import find_unused_parameters
from xgrad.torch_backend.comm import DEFAULT_TIMEOUT_S, TorchComm
from xgrad.torch_backend.ddp_hooks import GradientHooks, future_hook
from xgrad.torch_backend.ddp_params import reduced_parameters, resolve_devices
from xgrad.torch_backend.ddp_stats import IterationTimes as IterationTimes
from xgrad.torch_backend.ddp_stats import statistics
from xgrad.torch_backend.ops import TorchArrayOps
from xgrad.torch_backend.sync import broadcast_state, verify_params_across_ranks

__all__ = ["DistributedDataParallel", "IterationTimes"]

_MIB = 1024 * 1024


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
        timeout: float = DEFAULT_TIMEOUT_S,
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
        self.parameter_names, self._params, sparse = reduced_parameters(module, ignore)
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
        self.device_type, self.device_ids, self.output_device = resolve_devices(
            self._params, device_ids, output_device
        )
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
        self._grad_hooks = GradientHooks(self._params, gradient_as_bucket_view)
        self.reducer = Reducer(
            self._params,
            plan,
            self.comm,
            ops,
            set_grad=self._grad_hooks.set_grad,
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
        self._grad_hooks.reducer = self.reducer
        if comm_hook is not None:
            self.register_hook(comm_hook(self.comm))
        if gradient_as_bucket_view:
            self._grad_hooks.alias_grads_to_buckets()
        self._grad_hooks.attach(self.reducer)

    # ------------------------------------------------------------------ forward

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and self.reducer.rebuild_buckets() and self.gradient_as_bucket_view:
            self._grad_hooks.alias_grads_to_buckets()
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
            self._grad_hooks.sync_pending = True
            self._grad_hooks.forward_seconds = time.perf_counter() - start
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
        self.register_hook(future_hook(state, hook, self.timeout))
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
        if self.reducer.num_iterations or self._grad_hooks.sync_pending:
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
        return statistics(
            reducer=self.reducer,
            names=self.parameter_names,
            initial_plan=self.initial_plan,
            plan_is_explicit=self.plan_is_explicit,
            timeline=self.timeline,
        )

    @property
    def timeline(self) -> deque[IterationTimes]:
        """The kept iterations' timelines, oldest first."""
        return self._grad_hooks.timeline
