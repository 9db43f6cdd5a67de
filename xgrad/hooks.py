"""Communication hooks written once for every array library (NumPy, torch, JAX).

A hook turns a bucket into an in-flight reduction. These are written against the Python
array API (through ``array-api-compat``) and never write into their input, so the same
function runs on NumPy ranks, on torch tensors inside xgrad's DDP, and on JAX tracers
inside ``pmap``/``shard_map``. The arithmetic is PyTorch's own hooks' (``default_hooks``):
divide by the world size before the sum, and for compression cast first, so results
agree bit for bit with ``fp16_compress_hook`` wherever the sum is done in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xgrad.backend import Comm, Work
from xgrad.reducer import GradBucket, Hook

__all__ = [
    "HOOKS",
    "HOOK_NAMES",
    "HookSpec",
    "Then",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "resolve_hook",
]


class Then:
    """A :class:`~xgrad.backend.Work` whose result is ``fn`` of another one's result."""

    def __init__(self, work: Work, fn: Callable[[Any], Any]) -> None:
        self._work = work
        self._fn = fn

    def wait(self) -> Any:
        return self._fn(self._work.wait())


def _namespace(x: Any) -> Any:
    try:
        from array_api_compat import array_namespace
    except ImportError as err:
        raise ImportError(
            "xgrad's compression hooks need array-api-compat: pip install 'xgrad[hooks]'"
        ) from err
    return array_namespace(x)


def _bfloat16(xp: Any) -> Any:
    """The bfloat16 dtype of ``xp``'s library (NumPy has none of its own: ml_dtypes')."""
    dtype = getattr(xp, "bfloat16", None)
    if dtype is not None:
        return dtype
    try:
        import ml_dtypes
    except ImportError as err:
        raise ImportError(
            "bf16 compression of NumPy arrays needs ml_dtypes: pip install 'xgrad[hooks]'"
        ) from err
    return ml_dtypes.bfloat16


def allreduce_hook(comm: Comm) -> Hook:
    """Average: divide by the world size, then sum over ranks (PyTorch's ``allreduce_hook``)."""

    def hook(bucket: GradBucket) -> Work:
        return comm.allreduce(bucket.buffer() / comm.size)

    return hook


def _compress_hook(comm: Comm, pick_dtype: Callable[[Any], Any]) -> Hook:
    def hook(bucket: GradBucket) -> Work:
        buffer = bucket.buffer()
        xp = _namespace(buffer)
        compressed = xp.astype(buffer, pick_dtype(xp)) / comm.size
        return Then(comm.allreduce(compressed), lambda reduced: xp.astype(reduced, buffer.dtype))

    return hook


def fp16_compress_hook(comm: Comm) -> Hook:
    """Halve the bytes on the wire: cast to float16, divide, sum, cast back.

    The loss of precision is the point of comparison: xgrad's crosscheck attributes the
    difference against uncompressed reduction to this hook.
    """
    return _compress_hook(comm, lambda xp: xp.float16)


def bf16_compress_hook(comm: Comm) -> Hook:
    """As :func:`fp16_compress_hook` with bfloat16 (float32's range, 8 bits of mantissa).

    Unlike PyTorch's, this runs on CPU tensors too: nothing here needs CUDA.
    """
    return _compress_hook(comm, _bfloat16)


#: Every communication hook a step or a command line may name: the array-API hooks below,
#: and ``"powersgd"`` (PyTorch's ``powerSGD_hook`` at rank 1, which each backend realises
#: in its own way). Each backend's runners say which of these they run.
HOOK_NAMES: tuple[str, ...] = ("allreduce", "fp16", "bf16", "powersgd")

#: hook name -> factory of the array-API hooks written here, for command lines and plans
#: saved as text (a subset of :data:`HOOK_NAMES`).
HOOKS: dict[str, Callable[[Comm], Hook]] = {
    "allreduce": allreduce_hook,
    "fp16": fp16_compress_hook,
    "bf16": bf16_compress_hook,
}


#: what a data-parallel wrapper accepts as its hook: a name of :data:`HOOKS`, a factory
#: ``comm -> Hook``, or None (sum, then divide by the world size).
HookSpec = str | Callable[[Comm], Hook] | None


def resolve_hook(hook: HookSpec, comm: Comm) -> Hook | None:
    """The hook ``hook`` names or makes, for ``comm``.

    Raises:
        ValueError: a name that is not one of :data:`HOOKS` (listing them).
        TypeError: neither a name, a factory nor None.
    """
    if hook is None:
        return None
    if isinstance(hook, str):
        if hook not in HOOKS:
            raise ValueError(f"hook={hook!r} is not one of {sorted(HOOKS)}")
        return HOOKS[hook](comm)
    if not callable(hook):
        raise TypeError(f"hook={hook!r}: expected a hook name, a factory comm -> hook, or None")
    return hook(comm)
