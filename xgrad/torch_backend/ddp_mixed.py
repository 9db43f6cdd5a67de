"""DDP's ``mixed_precision``: compute in ``param_dtype``, reduce in ``reduce_dtype``.

PyTorch's DDP (``_MixedPrecision``) keeps each parameter's full-precision tensor and,
before every forward pass, points the parameter at a low-precision copy; the gradients
arrive in ``param_dtype``, the buckets hold them in that dtype, a communication hook
casts a bucket to ``reduce_dtype``, sums it, divides by the world size and points the
parameters (and their gradients) back at full precision. PyTorch does the copies on a
side stream, which needs an accelerator; here they run in line, so the CPU path works and
the arithmetic (casts, sum, then division) is the same.

A module converted behind the DDP's back (``ddp.module.double()``, ``.half()``) was
silently undone: the next forward pass cast the kept full-precision tensors, and the
backward pass pointed the parameters back at them. Each forward pass now compares the
parameters' dtypes with the kept tensors' (one C call for them all,
:meth:`MixedPrecisionCasts.wrong_dtype`) and the DDP refuses a mismatch on every rank,
with the :class:`~xgrad.reducer_errors.GradientDtypeError` of a converted module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from xgrad.backend import Work
from xgrad.reducer import GradBucket, Hook
from xgrad.reducer_errors import GradientDtypeError
from xgrad.torch_backend.comm import TorchComm
from xgrad.torch_backend.ops import dtypes_of


class _Done:
    """A reduction that already finished (the hook waits in line)."""

    __slots__ = ("_value",)

    def __init__(self, value: torch.Tensor) -> None:
        self._value = value

    def wait(self) -> torch.Tensor:
        return self._value


class MixedPrecisionCasts:
    """The parameter and buffer casts of DDP mixed precision, for one module.

    Args:
        config: a ``torch.nn.parallel.distributed._MixedPrecision`` (``param_dtype``,
            ``reduce_dtype``, ``buffer_dtype``).
        module: the wrapped module.
        ignore: names of parameters and buffers DDP ignores (never cast).
    """

    def __init__(self, config: Any, module: nn.Module, ignore: set[str]) -> None:
        self.param_dtype: torch.dtype | None = config.param_dtype
        self.reduce_dtype: torch.dtype | None = config.reduce_dtype
        named = [(n, p) for n, p in module.named_parameters() if n not in ignore]
        self._names = [n for n, _ in named]  # aligned with params (for the errors)
        self.params = [p for _, p in named]
        self._full = {id(p): p.data for p in self.params}
        self._full_dtypes = dtypes_of(self.params)
        #: the last backward pass pointed every parameter back at full precision: no
        #: parameter may hold ``param_dtype`` now (one converted to it is caught too).
        self._settled = False
        if config.buffer_dtype is not None:
            # Every buffer DDP does not ignore, integer ones too (BatchNorm's
            # num_batches_tracked), as PyTorch's _cast_buffers casts them: the same dtypes
            # in the state_dict.
            for name, buf in module.named_buffers():
                if name not in ignore:
                    buf.data = buf.to(dtype=config.buffer_dtype)

    def wrong_dtype(self, rank: int) -> GradientDtypeError | None:
        """Before the forward pass: the error for a parameter converted behind the DDP's
        back (its dtype neither its kept tensor's nor, while it may hold its
        low-precision copy, ``param_dtype``); ``None`` when none was."""
        dtypes = dtypes_of(self.params)
        if dtypes == self._full_dtypes:
            return None
        low = self.param_dtype
        if not self._settled and low is not None and dtypes.count(low) == len(dtypes):
            return None  # still the copies of the last pass (no_sync, no backward)
        for name, dtype, full in zip(self._names, dtypes, self._full_dtypes, strict=True):
            if dtype is not full and (self._settled or dtype is not low):
                return GradientDtypeError(
                    f"Parameter {name} is {dtype} but mixed_precision keeps it in {full} "
                    f"on rank {rank}: the module's parameters were converted "
                    "(module.double(), .half(), .float(), perhaps of one submodule) after "
                    "DistributedDataParallel was constructed, and its full-precision "
                    "copies, which every backward pass points the parameters back at, "
                    "would undo that. Convert the module before constructing "
                    "DistributedDataParallel (or wrap it again after converting it)."
                )
        return None

    def to_low(self, inputs: Any, kwargs: Any) -> tuple[Any, Any]:
        """Before the forward pass: parameters (and accumulated gradients) in
        ``param_dtype``; returns the inputs cast to it (floating-point tensors only)."""
        if self.param_dtype is None:
            return inputs, kwargs
        self._settled = False
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.data = p.grad.to(self.param_dtype)
                p.data = self._full[id(p)].to(self.param_dtype)
        from torch.distributed.utils import _cast_forward_inputs

        return _cast_forward_inputs(self.param_dtype, *inputs, **kwargs)

    def to_full(self, params: Sequence[torch.Tensor]) -> None:
        """Point ``params`` back at their full-precision tensors and upcast their gradients."""
        for p in params:
            full = self._full[id(p)]
            if p.data is not full:
                p.data = full
            if p.grad is not None and p.grad.dtype != full.dtype:
                p.grad.data = p.grad.to(full.dtype)

    def frozen_to_full(self) -> None:
        """End of backward: parameters without a gradient hook go back too (as PyTorch)."""
        self.to_full([p for p in self.params if not p.requires_grad])
        self._settled = dtypes_of(self.params) == self._full_dtypes

    def hook(self, comm: TorchComm) -> Hook:
        """The reduction: cast to ``reduce_dtype``, sum, divide, then upcast the parameters."""

        def reduce_and_upcast(bucket: GradBucket) -> Work:
            buffer = bucket.buffer()
            if self.reduce_dtype is not None and self.reduce_dtype != buffer.dtype:
                buffer = buffer.to(self.reduce_dtype)
                bucket.set_buffer(buffer)
            comm.allreduce(buffer).wait()
            buffer.div_(comm.size)
            self.to_full(bucket.parameters())
            return _Done(buffer)

        return reduce_and_upcast
