"""Communication hooks on the DDP: PyTorch's ``hook(state, bucket) -> Future`` and xgrad's own.

PyTorch's hooks (``default_hooks``, PowerSGD, the fused optimizer of
``_register_fused_optim``) run unchanged on the reducer's buckets: the bucket they get has
``GradBucket``'s methods and row-major gradients, the future they return becomes the
reducer's :class:`~xgrad.backend.Work`, waited on with the DDP's timeout. Every hook runs
under the DDP's failure watch, so a hook that raises on one rank makes every rank raise,
naming it and the bucket.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from xgrad.backend import Work
from xgrad.reducer import GradBucket, Hook, Reducer
from xgrad.torch_backend.ddp_failure import StepWatch
from xgrad.torch_backend.ddp_logging import RuntimeLog
from xgrad.torch_backend.ddp_watched import WatchedFuture

__all__ = [
    "CommHookDDP",
    "builtin_hook",
    "callbacks_compute_only",
    "check_comm_hook",
    "future_hook",
]


class CommHookDDP:
    """Mixed into the DDP: ``register_comm_hook`` (PyTorch's) and ``register_hook`` (xgrad's)."""

    reducer: Reducer
    process_group: Any
    comm: Any
    _watch: StepWatch
    _agreement_pending: bool
    _hook_name: str
    _runtime_log: RuntimeLog

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Register a PyTorch communication hook, ``hook(state, bucket) -> Future``.

        PyTorch's own hooks (``default_hooks.allreduce_hook``, ``fp16_compress_hook``,
        ``bf16_compress_hook``, ``powerSGD_hook.powerSGD_hook``, the fused optimizer of
        ``_register_fused_optim``) run unchanged: the bucket they get has
        ``GradBucket``'s methods. The returned future is waited on with this module's
        timeout. Call once, before the first forward pass. The hook's signature is
        checked first, as PyTorch checks it (:func:`check_comm_hook`).
        """
        try:
            check_comm_hook(hook)
        except Exception as exc:
            self._runtime_log.error(exc)  # PyTorch's logger keeps it
            raise
        # Gloo runs a future's callbacks as collectives complete, in an order that differs
        # between ranks; PowerSGD issues collectives there (PyTorch's DDP hangs), so on
        # gloo buckets' hooks run one after another, unless the hook is known to issue
        # none in its callbacks. NCCL keeps stream order: overlap.
        serial = dist.get_backend(self.comm.group) != "nccl" and not callbacks_compute_only(hook)
        watch = self._watch
        # PyTorch's hooks reduce over WORLD when their state is None: the private group here.
        run = future_hook(lambda: watch.group if state is None else state, hook, watch)
        self.reducer.register_hook(
            lambda bucket: watch.call(f"comm hook, bucket {bucket.index()}", run, bucket),
            serial=serial,
        )
        self._hook_name = getattr(hook, "__qualname__", type(hook).__name__)
        self._runtime_log.keys["comm_hook"] = self._hook_name  # PyTorch's logging key
        self._agreement_pending = True  # the ranks compare hooks again at the next step
        self._hook_state = state  # per-bucket memories a conversion clears (ddp._apply)

    def register_hook(self, hook: Hook) -> None:
        """Register a backend-neutral hook with its state bound (``bucket -> Work``).

        Example: ``ddp.register_hook(xgrad.hooks.fp16_compress_hook(ddp.comm))``.
        """
        watch = self._watch
        self.reducer.register_hook(
            lambda bucket: watch.call(f"comm hook, bucket {bucket.index()}", hook, bucket)
        )
        self._hook_name = getattr(hook, "__qualname__", type(hook).__name__)
        self._agreement_pending = True  # the ranks compare hooks again at the next step

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """PyTorch's built-in C++ hooks (``ALLREDUCE``, ``FP16_COMPRESS``), as Python hooks."""
        self.register_comm_hook(self.process_group, builtin_hook(comm_hook_type))
        self._runtime_log.keys["comm_hook"] = str(comm_hook_type)  # PyTorch logs the type


def _meaning(annotation: Any, hook: Callable[..., Any]) -> Any:
    """``annotation`` evaluated where ``hook`` was written, if it is postponed text
    (``from __future__ import annotations``); text that cannot be evaluated there (a
    name imported under ``TYPE_CHECKING`` or inside a function) counts as none."""
    if not isinstance(annotation, str):
        return annotation
    namespace = getattr(inspect.unwrap(hook), "__globals__", {})
    try:
        return eval(annotation, namespace)  # what typing.get_type_hints does
    except Exception:
        return inspect.Parameter.empty


def check_comm_hook(hook: object) -> None:
    """The checks PyTorch 2.13's ``register_comm_hook`` makes (``_check_comm_hook``), with
    its exception types, so that a hook refused there is refused here.

    One difference: PyTorch compares postponed annotations (text) with the classes, so
    it refuses even ``bucket: dist.GradBucket`` under ``from __future__ import
    annotations``; here the text is evaluated first. Not copied either: PyTorch's refusal
    of the bf16 hook without NCCL (xgrad runs it on gloo) and its ``AttributeError`` for
    a hook without ``__name__`` (a ``functools.partial``, an object with ``__call__``).
    A wrong number of parameters fails when the hook is called, in the backward pass,
    as in PyTorch.

    Raises:
        TypeError: ``hook`` is not callable.
        KeyError: it has no parameter named ``bucket`` (PyTorch passes it by position,
            but reads the signature by that name).
        ValueError: ``bucket`` is annotated but not as ``dist.GradBucket``, or the return
            value is annotated but not as ``torch.futures.Future[torch.Tensor]``.
    """
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable, got {hook!r}")
    signature = inspect.signature(hook)
    name = getattr(hook, "__qualname__", type(hook).__name__)
    if "bucket" not in signature.parameters:
        raise KeyError(
            f"Communication hook {name}{signature} has no parameter named 'bucket': "
            "expected hook(state, bucket: dist.GradBucket)"
        )
    bucket = _meaning(signature.parameters["bucket"].annotation, hook)
    if bucket is not inspect.Parameter.empty and bucket != dist.GradBucket:
        raise ValueError(
            f"Communication hook: bucket annotation should be dist.GradBucket; {name} has "
            f"{signature.parameters['bucket'].annotation!r}"
        )
    returned = _meaning(signature.return_annotation, hook)
    if returned is not inspect.Parameter.empty and returned != torch.futures.Future[torch.Tensor]:
        raise ValueError(
            "Communication hook: return annotation should be "
            f"torch.futures.Future[torch.Tensor]; {name} has {signature.return_annotation!r}"
        )


def callbacks_compute_only(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is one of PyTorch's hooks whose future's callbacks issue no
    collective (they only divide or cast back), so that on gloo its buckets may overlap
    as they do on PyTorch's DDP: one bucket's reduction runs while the next is filled.

    Any other hook (PowerSGD, a wrapper, the user's own) is run bucket after bucket on
    gloo, since its callbacks might issue collectives in an order that differs between
    ranks. Measured with a timing hook on the bench's mlp at world size 4, that order
    launched the second bucket 7 ms later than PyTorch's DDP did.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    known = (
        default_hooks.allreduce_hook,
        default_hooks.fp16_compress_hook,
        default_hooks.bf16_compress_hook,
    )
    return any(hook is h for h in known)


def _row_major(bucket: GradBucket) -> GradBucket:
    """``bucket`` as PyTorch's ``GradBucket.gradients()`` shows it: each gradient a row-major
    view of its slice of the buffer, whatever the parameter's strides. The reducer's own
    views follow a dense parameter's strides (channels_last), as PyTorch's do; hooks such
    as PowerSGD reshape the gradients with ``view``, which needs PyTorch's row-major ones."""
    grads = bucket.gradients()
    if not any(
        g is not None and g.layout is torch.strided and not g.is_contiguous() for g in grads
    ):
        return bucket
    flat = bucket.buffer()
    views = []
    offset = 0
    for g in grads:
        views.append(flat.narrow(0, offset, g.numel()).view(g.shape))
        offset += g.numel()
    return GradBucket(bucket.index(), flat, views, bucket.parameters(), bucket.is_last())


def _as_reals(bucket: GradBucket) -> GradBucket:
    """A bucket of complex gradients as PyTorch's reducer hands it to a hook: its buffer
    the real view (two reals per number), so a hook that casts it (``fp16_compress_hook``)
    keeps the imaginary parts. Its gradients are the real views of each (shape ``(*shape,
    2)``): PyTorch's slice its real buffer by the complex lengths and view them in the
    parameters' shapes, which reads the wrong numbers."""
    flat = bucket.buffer()
    views = [None if g is None else torch.view_as_real(g) for g in bucket.gradients()]
    real = torch.view_as_real(flat).view(-1)
    return GradBucket(bucket.index(), real, views, bucket.parameters(), bucket.is_last())


def future_hook(state_of: Callable[[], object], hook: Callable[..., Any], watch: StepWatch) -> Hook:
    """A PyTorch communication hook ``hook(state, bucket) -> Future`` as a reducer hook.

    ``state_of()`` gives the state (it changes when the DDP replaces its private group
    after a failure). The returned future is waited on through ``watch`` (bounded, and
    stopped by a peer's failure); a hook that returns anything else raises PyTorch's
    ``RuntimeError``, in its words, naming the hook (PyTorch's DDP raises it in the
    backward pass too; for ``None`` it crashes).
    """
    name = getattr(hook, "__name__", type(hook).__name__)

    def run(bucket: GradBucket) -> Work:
        seen = _row_major(bucket)
        complex_ = seen.buffer().is_complex()
        future = hook(state_of(), _as_reals(seen) if complex_ else seen)
        if not isinstance(future, torch._C.Future):
            kind = type(future)
            raise RuntimeError(
                "DDP communication hook's callback must return a torch.futures.Future "
                f"object, but got {kind.__module__}.{kind.__qualname__} (from {name})"
            )
        what = f"comm hook {name}, bucket {bucket.index()}"
        return WatchedFuture(future, watch, what, complex_=complex_)

    return run


def builtin_hook(comm_hook_type: Any) -> Callable[..., Any]:
    """The Python twin of a PyTorch built-in C++ hook (``dist.BuiltinCommHookType``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {
        "ALLREDUCE": default_hooks.allreduce_hook,
        "FP16_COMPRESS": default_hooks.fp16_compress_hook,
    }
    name = getattr(comm_hook_type, "name", str(comm_hook_type))
    if name not in hooks:
        raise ValueError(f"comm_hook_type={comm_hook_type!r} is not one of {sorted(hooks)}")
    return hooks[name]
