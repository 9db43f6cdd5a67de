"""``DistributedDataParallel``: PyTorch's DDP, driven by xgrad's plan and reducer.

A drop-in for ``torch.nn.parallel.DistributedDataParallel`` (it *is* one, for
``isinstance``): the same constructor arguments and defaults, ``no_sync()``,
``register_comm_hook`` with PyTorch's own hooks, ``torch.compile``. The bucketing and
reduction are xgrad's backend-neutral :class:`~xgrad.reducer.Reducer` fed by
per-parameter autograd hooks, so what PyTorch keeps inside C++ can be looked at: the
plan, the order in which gradients became ready, the per-iteration timeline.

One training step, as PyTorch's DDP does it::

    forward    rebuild buckets once (from the last ready order; rank 0's plan wins)
               sync buffers from rank 0, run the module,
               walk the grad_fn graph for unused parameters (find_unused_parameters)
               reducer.prepare_for_backward(unused)
    backward   post-accumulate hook of parameter i -> reducer.mark_ready(i, grad), or
               only logged (ddp_arrivals) and marked by the next Python hook; the first
               queues finalize; a full bucket is copied in and launched in bucket order
    end        engine's final callback: reducer.finalize() waits for every bucket and
               writes the averaged gradients to .grad (or makes .grad the bucket view)

Pieces: ``ddp_params`` (which parameters, devices), ``ddp_args`` (group, buffer flags),
``ddp_checks`` (bad input), ``ddp_caps`` (bucket caps), ``ddp_hooks`` (autograd hooks),
``ddp_recover`` (a failed pass), ``ddp_unfinished`` (told to the peers), ``ddp_failure``
(the step watch), ``ddp_comm_hooks`` (hooks), ``ddp_stats`` (plan, timeline, statistics),
``ddp_forward`` (the forward pass), ``ddp_reduction`` (hooks and reducer, built),
``ddp_mixed`` (mixed precision), ``ddp_delay`` (delayed all-reduce), ``ddp_compile``
(dynamo), ``ddp_pickle`` (copies), ``join``; this is the wrapper and its construction.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Joinable

from xgrad.backend import Comm
from xgrad.buckets import BucketPlan
from xgrad.reducer import Hook, Reducer
from xgrad.torch_backend.ddp_args import buffer_sync_flags, resolve_group
from xgrad.torch_backend.ddp_buffers import BufferSyncDDP
from xgrad.torch_backend.ddp_caps import resolve_caps
from xgrad.torch_backend.ddp_checks import (
    check_params,
    check_plan,
    resolve_timeout,
    warn_as_pytorch,
)
from xgrad.torch_backend.ddp_comm_hooks import CommHookDDP
from xgrad.torch_backend.ddp_compat import CompatDDP
from xgrad.torch_backend.ddp_convert import ConvertibleDDP
from xgrad.torch_backend.ddp_delay import DelayedAllReduce
from xgrad.torch_backend.ddp_failure import StepWatch
from xgrad.torch_backend.ddp_forward import ForwardDDP
from xgrad.torch_backend.ddp_logging import RuntimeLog, environment
from xgrad.torch_backend.ddp_params import reduced_parameters, resolve_devices
from xgrad.torch_backend.ddp_pickle import PicklableDDP
from xgrad.torch_backend.ddp_reduction import ReductionDDP
from xgrad.torch_backend.ddp_stats import InspectableDDP
from xgrad.torch_backend.ddp_stats import IterationTimes as IterationTimes
from xgrad.torch_backend.ddp_unfinished import before_wrapping
from xgrad.torch_backend.ddp_watched_comm import WatchedComm
from xgrad.torch_backend.join import JoinableDDP
from xgrad.torch_backend.sync import broadcast_state, verify_params_across_ranks
from xgrad.torch_backend.weak_hooks import weak_method

__all__ = ["DistributedDataParallel", "IterationTimes"]

_TorchDDP = torch.nn.parallel.DistributedDataParallel


class DistributedDataParallel(
    ConvertibleDDP,
    ForwardDDP,
    BufferSyncDDP,
    CompatDDP,
    InspectableDDP,
    ReductionDDP,
    PicklableDDP,
    JoinableDDP,
    CommHookDDP,
    _TorchDDP,
):
    """Data parallelism over a process group, with PyTorch DDP's arguments and behaviour.

    It subclasses ``torch.nn.parallel.DistributedDataParallel`` without running that
    class's ``__init__`` (which would build PyTorch's C++ reducer too), so ``isinstance``
    holds for the code in Lightning, accelerate and transformers that unwraps DDP, and
    dynamo's DDP handling (``DDPOptimizer``, guards) applies (torch's class takes no
    ``__instancecheck__``; ``ABC.register`` fails dynamo's ``issubclass``). Every method
    of torch's class that would reach its C++ reducer is overridden; the rest
    (``_inside_ddp_forward``, ``_register_fused_optim``, ``scatter``/``gather``,
    ``no_sync``, ``will_sync_module_buffers``) work unchanged.

    Args:
        module, device_ids, output_device, dim, broadcast_buffers, init_sync,
        process_group, bucket_cap_mb, find_unused_parameters, check_reduction,
        gradient_as_bucket_view, static_graph, delay_all_reduce_named_params,
        param_to_hook_all_reduce, mixed_precision, device_mesh,
        skip_all_reduce_unused_params, bucket_cap_mb_list, batched_grad_copy,
        forward_sync_buffers: as in PyTorch 2.13's DDP (``mixed_precision`` also on CPU).
        first_bucket_cap_mb: cap of the first bucket (xgrad extra).
        plan: an explicit :class:`~xgrad.buckets.BucketPlan` over the reduced parameters,
            used as given (no rebuild).
        comm_hook: a backend-neutral hook factory (``xgrad.hooks.fp16_compress_hook``),
            called with this module's ``comm``.
        timeout: seconds (or a ``timedelta``) any wait on a peer may block before it
            raises (default ``$XGRAD_DDP_TIMEOUT``, else 300): reductions, the buffer
            broadcast, the rebuild broadcast and the agreement check alike.

    Before the first reduction and after a rebuild the ranks compare plan, parameters
    and hook (:mod:`xgrad.agreement`); ``join()`` is PyTorch's (:mod:`.join`); a failed
    backward pass is dropped at the next forward pass, with a warning.

    Example:
        >>> ddp = DistributedDataParallel(model)  # doctest: +SKIP
        >>> ddp(x).sum().backward()  # .grad now averaged over ranks
    """

    #: xgrad's reducer (where PyTorch's class keeps its C++ one).
    reducer: Reducer  # type: ignore[assignment]

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        first_bucket_cap_mb: float | None = None,
        plan: BucketPlan | None = None,
        comm_hook: Callable[[Comm], Hook] | None = None,
        timeout: float | timedelta | None = None,
    ) -> None:
        nn.Module.__init__(self)
        Joinable.__init__(self)
        warn_as_pytorch(check_reduction, static_graph, find_unused_parameters)
        timeout = resolve_timeout(timeout)
        caps = resolve_caps(
            bucket_cap_mb,
            first_bucket_cap_mb,
            bucket_cap_mb_list,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
        )
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError(
                "delay_all_reduce_named_params and param_to_hook_all_reduce "
                "need to be set at the same time."
            )
        self.module = module
        self.process_group, self.device_mesh = resolve_group(process_group, device_mesh)
        before_wrapping()  # a failed DDP told, a dropped one's hooks gone
        self._watch = StepWatch(self.process_group, timeout)
        self.comm = WatchedComm(self._watch)
        self.dim = dim
        self.forward_sync_buffers, init_sync_buffers = buffer_sync_flags(
            broadcast_buffers, forward_sync_buffers
        )
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.mixed_precision = mixed_precision
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.timeout = timeout

        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        delayed = list(delay_all_reduce_named_params or ())
        ignore |= {name for name, _ in delayed}
        self.parameters_to_ignore = ignore
        self._delay_all_reduce_params = [p for _, p in delayed]  # PyTorch's attribute
        # PyTorch's attributes that code around DDP reads (ZeRO's hook, compile): as there.
        self._module_parameters = [p for n, p in module.named_parameters() if n not in ignore]
        self._delay_all_reduce_all_params = False  # refused below, where PyTorch allows it
        self._comm_hooks: list[tuple[Any, object]] = []  # PyTorch's python-reducer list
        self._use_python_reducer = False
        self._lazy_init_ran = False
        self.parameter_names, self._params, sparse = reduced_parameters(module, ignore)
        if not self._params:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any "
                "parameter that requires a gradient"
                + (" (every one is in delay_all_reduce_named_params)." if delayed else ".")
            )
        check_params(self.parameter_names, self._params)
        plan = check_plan(plan, len(self._params))
        self.device_type, self.device_ids, self.output_device = resolve_devices(
            self._params, device_ids, output_device
        )
        self.device = self._params[0].device
        self.logger = None  # set before PyTorch's checks below, which log through it
        self._passing_sync_batchnorm_handle(module)  # PyTorch's: SyncBatchNorm needs a GPU
        self.is_multi_device_module = len({p.device for p in module.parameters()}) > 1
        self._assign_modules_buffers()  # modules_buffers, named_module_buffers (PyTorch's)
        #: PyTorch's attributes, for code that reads them (``logger`` is None, above: no
        #: C++ logger, so ``_log_and_throw`` only raises; ``_get_ddp_logging_data`` is
        #: xgrad's: ddp_logging).
        self.broadcast_bucket_size = 250 * 1024 * 1024
        self.use_side_stream_for_tensor_copies = (
            os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"
        )

        if init_sync:
            verify_params_across_ranks(self.comm, self.parameter_names, self._params)
            broadcast_state(self.comm, module, buffers=init_sync_buffers, ignore=ignore)
        self._delayed = (
            None
            if param_to_hook_all_reduce is None
            else DelayedAllReduce(
                [p for _, p in delayed],
                [n for n, _ in delayed],
                param_to_hook_all_reduce,
                self.comm,
                self.device,
            )
        )
        self._agreement_pending = True  # before the first reduction and after a rebuild
        self._divide_by_initial_world_size = True
        self._join_uneven_inputs = False  # a join hook was made (PyTorch's logged key)
        self._still_training: int | None = None
        self._forward_started = 0.0
        #: PyTorch's logger's keys (``_get_ddp_logging_data``): read now, and sampled.
        self._logging_environment = environment(self.process_group)
        self._runtime_log = RuntimeLog()
        self._build_reduction(caps, plan, sparse, comm_hook, default_cap=bucket_cap_mb is None)
        if self._delayed is not None:  # the used map first (skip_all_reduce_unused_params)
            self._delayed.before_launch = weak_method(self.reducer.sum_used_map)
