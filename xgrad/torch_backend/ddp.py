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

from xgrad.agreement import check_agreement
from xgrad.backend import Comm
from xgrad.buckets import (
    BucketPlan,
    ddp_bucket_caps,
    ddp_initial_plan,
)
from xgrad.reducer import Hook, Reducer
from xgrad.torch_backend.autograd_graph import find_unused_parameters
from xgrad.torch_backend.ddp_checks import (
    check_params,
    check_plan,
    fingerprint,
    resolve_caps,
    resolve_timeout,
)
from xgrad.torch_backend.ddp_failure import StepWatch, WatchedComm
from xgrad.torch_backend.ddp_hooks import GradientHooks, future_hook
from xgrad.torch_backend.ddp_params import reduced_parameters, resolve_devices
from xgrad.torch_backend.ddp_stats import IterationTimes as IterationTimes
from xgrad.torch_backend.ddp_stats import statistics
from xgrad.torch_backend.join import (
    Joinable,
    JoinableDDP,
    announce_backward_sync,
    notify_join_context,
)
from xgrad.torch_backend.ops import TorchArrayOps
from xgrad.torch_backend.sync import broadcast_state, verify_params_across_ranks

__all__ = ["DistributedDataParallel", "IterationTimes"]


class DistributedDataParallel(nn.Module, JoinableDDP):
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
        timeout: seconds any wait on a peer may block before it raises (default
            ``$XGRAD_DDP_TIMEOUT``, else 300): reductions, the buffer broadcast, the
            rebuild broadcast and the agreement check alike.

    Before the first reduction and after a rebuild the ranks compare plan, parameters
    and hook (:mod:`xgrad.agreement`); ``join()`` is PyTorch's; a failed backward pass
    is dropped at the next forward pass, with a warning.

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
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        timeout = resolve_timeout(timeout)
        cap_bytes, first_cap_bytes = resolve_caps(bucket_cap_mb, first_bucket_cap_mb)
        self.module = module
        self.process_group = process_group
        self._watch = StepWatch(process_group, timeout)
        self.comm = WatchedComm(self._watch)
        self.dim = dim
        self.broadcast_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.timeout = timeout

        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self._ignored = ignore
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
        check_params(self.parameter_names, self._params)
        plan = check_plan(plan, len(self._params))
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
        first, cap = ddp_bucket_caps(cap_bytes, first_cap_bytes)
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
        self._hook_name = "allreduce (default)"
        self._agreement_pending = True  # before the first reduction and after a rebuild
        self._divide_by_initial_world_size = True
        self._grad_hooks.reducer = self.reducer
        self._grad_hooks.watch = self._watch
        if comm_hook is not None:
            self.register_hook(comm_hook(self.comm))
        if gradient_as_bucket_view:
            self._grad_hooks.alias_grads_to_buckets()
        self._grad_hooks.attach(self.reducer)

    # ------------------------------------------------------------------ forward

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        grad_enabled = torch.is_grad_enabled()
        sync = grad_enabled and self.require_backward_grad_sync
        self._watch.start_forward(self._grad_hooks, sync)
        still_training = notify_join_context(self)
        if grad_enabled and self.reducer.rebuild_buckets():
            self._agreement_pending = True
            if self.gradient_as_bucket_view:
                self._grad_hooks.alias_grads_to_buckets()
        if self._will_sync_buffers():
            self._sync_buffers()
        if self._join_config.enable:
            announce_backward_sync(self, sync)
        if sync:
            self._check_agreement()
        if self.device_ids:
            device = torch.device(self.device_type, self.device_ids[0])
            inputs, kwargs = tree_map(
                lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, (inputs, kwargs)
            )
        output = self._watch.call("forward", self.module, *inputs, **kwargs)
        if sync:
            self.require_forward_param_sync = True
            unused: Sequence[int] = ()
            if self.find_unused_parameters and not self.static_graph:
                unused = find_unused_parameters(output, self._param_index, len(self._params))
            self.reducer.prepare_for_backward(unused, divisor=still_training)
            self._grad_hooks.sync_pending = True
            self._grad_hooks.forward_seconds = time.perf_counter() - start
        else:
            self.require_forward_param_sync = False
        return output

    def _check_agreement(self) -> None:
        """Compare plan, parameters and hook across ranks, once per plan (a collective)."""
        if self._agreement_pending:
            mine = fingerprint(self.plan, self.parameter_names, self._params, self._hook_name)
            check_agreement(self.comm, mine, where="DistributedDataParallel")
            self._agreement_pending = False

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
        watch = self._watch
        # PyTorch's hooks reduce over WORLD when their state is None: the private group here.
        self.register_hook(
            future_hook(lambda: watch.group if state is None else state, hook, watch)
        )
        self._hook_name = getattr(hook, "__qualname__", type(hook).__name__)
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
        watch = self._watch
        self.reducer.hook = lambda bucket: watch.call(
            f"comm hook, bucket {bucket.index()}", hook, bucket
        )
        self._hook_registered = True
        self._hook_name = getattr(hook, "__qualname__", type(hook).__name__)

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
