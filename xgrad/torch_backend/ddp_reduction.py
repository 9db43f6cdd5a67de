"""The DDP's reduction, built: gradient hooks in, xgrad's reducer, a comm hook, .grad out.

Kept apart from the wrapper's construction (:mod:`.ddp`), which resolves the arguments,
checks the parameters and syncs the initial state: this is what turns the parameters
that are left into reductions, and what changes them after (``_set_static_graph``).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from xgrad.backend import Comm
from xgrad.buckets import BucketPlan
from xgrad.ddp_setup import ddp_reducer
from xgrad.reducer import Hook, Reducer
from xgrad.torch_backend.ddp_caps import Caps
from xgrad.torch_backend.ddp_checks import warn_as_pytorch
from xgrad.torch_backend.ddp_failure import StepWatch
from xgrad.torch_backend.ddp_hooks import GradientHooks
from xgrad.torch_backend.ddp_logging import RuntimeLog
from xgrad.torch_backend.ddp_mixed import MixedPrecisionCasts
from xgrad.torch_backend.ops import TorchArrayOps
from xgrad.torch_backend.weak_hooks import weak_method

__all__ = ["ReductionDDP"]


class ReductionDDP:
    """Mixed into the DDP: builds its gradient hooks and reducer (:meth:`_build_reduction`)."""

    module: nn.Module
    mixed_precision: Any
    parameters_to_ignore: set[str]
    parameter_names: list[str]
    comm: Any
    find_unused_parameters: bool
    static_graph: bool
    gradient_as_bucket_view: bool
    skip_all_reduce_unused_params: bool
    batched_grad_copy: bool
    reducer: Reducer
    _params: list[nn.Parameter]
    _watch: StepWatch
    _runtime_log: RuntimeLog

    if TYPE_CHECKING:

        def register_hook(self, hook: Hook) -> None: ...  # CommHookDDP's

    def _build_reduction(
        self,
        caps: Caps,
        plan: BucketPlan | None,
        sparse: Sequence[bool],
        comm_hook: Callable[[Comm], Hook] | None,
        *,
        default_cap: bool,
    ) -> None:
        """The casts of ``mixed_precision``, the gradient hooks, PyTorch's bucket cap
        attributes, the reducer, ``comm_hook`` and the hooks attached, in that order
        (``default_cap``: no ``bucket_cap_mb`` was given)."""
        find_unused_parameters, static_graph = self.find_unused_parameters, self.static_graph
        gradient_as_bucket_view = self.gradient_as_bucket_view
        mixed_precision, module = self.mixed_precision, self.module
        self._casts = (
            None
            if mixed_precision is None
            else MixedPrecisionCasts(mixed_precision, module, self.parameters_to_ignore)
        )
        flat_dtype = None if self._casts is None else self._casts.param_dtype
        self._grad_hooks = GradientHooks(
            self._params, gradient_as_bucket_view, lend=flat_dtype is None
        )
        limits = caps.limits(
            find_unused_parameters=find_unused_parameters, static_graph=static_graph
        )
        #: PyTorch's attribute (dynamo's DDPOptimizer splits graphs at this size).
        self.bucket_bytes_cap = caps.attribute(limits.bucket_bytes_cap)
        self.bucket_bytes_cap_list = list(caps.cap_list or ())
        #: whether the first bucket is PyTorch's small default one (no cap given).
        self.bucket_bytes_cap_default = default_cap and caps.cap_list is None
        hooks = self._grad_hooks
        # The reducer holds the DDP and its hooks weakly (they hold it): a dropped DDP is
        # freed at once, not left in a cycle for the collector (weak_hooks).
        self.reducer = ddp_reducer(
            self._params,
            self.comm,
            TorchArrayOps(flat_dtype=flat_dtype),
            set_grad=weak_method(hooks.set_grad),
            set_grads=weak_method(hooks.set_grads),
            limits=limits,
            plan=plan,
            names=self.parameter_names,
            sparse=sparse,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            skip_all_reduce_unused_params=self.skip_all_reduce_unused_params,
            batched_grad_copy=self.batched_grad_copy,
            hook=None if self._casts is None else self._casts.hook(self.comm),
            lender=weakref.proxy(hooks),
            # An unused parameter's bucket slot gets its .grad, as PyTorch's (not with
            # mixed precision, whose buckets hold the low-precision gradients).
            get_grad=None if self._casts is not None else weak_method(self._grad_of),
        )
        self.initial_plan = self.reducer.initial_plan
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        self._hook_name = "allreduce (default)" if self._casts is None else "mixed precision"
        self._grad_hooks.watch = self._watch
        self._grad_hooks.log_error = self._runtime_log.error
        self._grad_hooks.joining = _joining(weakref.ref(self))
        # PyTorch names the parameters in its "prior iteration" error only when debugging.
        self.reducer.name_unreduced = dist.get_debug_level() != dist.DebugLevel.OFF
        if comm_hook is not None:
            self.register_hook(comm_hook(self.comm))
        self._grad_hooks.attach(self.reducer)
        if gradient_as_bucket_view:
            self._grad_hooks.alias_grads_to_buckets()
            if self._casts is None:  # before each bucket's hook, as PyTorch's
                self.reducer.point_grads = weak_method(hooks.point_grads)
        if self._casts is not None:
            self._grad_hooks.after_backward = self._casts.frozen_to_full

    def _grad_of(self, index: int) -> torch.Tensor | None:
        return self._params[index].grad

    # --- graph

    def _set_static_graph(self) -> None:
        """PyTorch's late ``static_graph=True``: call before the first iteration."""
        if self.static_graph:
            warnings.warn(
                "You've set static_graph to be True, no need to set it again.", stacklevel=2
            )
            return
        try:
            self.reducer.set_static_graph()
        except RuntimeError as exc:
            self._runtime_log.error(exc)
            raise
        self.static_graph = True
        warn_as_pytorch(False, True, self.find_unused_parameters)


def _joining(ref: weakref.ref[Any]) -> Callable[[], bool]:
    """Whether the DDP ``ref`` is under ``join()`` now (its config changes with each join
    context made): asked by its gradient hooks, which hold it weakly (a dropped DDP is
    freed at once), when a backward pass raised (:mod:`.ddp_cut_short`)."""

    def joining() -> bool:
        ddp = ref()
        return ddp is None or bool(ddp._join_config.enable)

    return joining
