"""Communication hooks on the DDP: PyTorch's built-in hook types, the hook's checks.

In process: the built-in types map to PyTorch's Python twins and an unknown one is named;
a hook's signature is refused or accepted as PyTorch's ``_check_comm_hook`` does, with
its exception type (run side by side); a hook that returns something other than a
future raises PyTorch's ``RuntimeError``; a channels_last gradient reaches the hook as a
row-major view of the bucket. Runs of two gloo ranks: ``_register_builtin_comm_hook(
FP16_COMPRESS)`` on xgrad's DDP gives PyTorch's DDP's gradients with the same built-in
hook, step by step; a hook returning a tensor fails the backward pass of both DDPs alike.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from xgrad.reducer import GradBucket
from xgrad.torch_backend.ddp_comm_hooks import (
    _row_major,
    builtin_hook,
    callbacks_compute_only,
    check_comm_hook,
    future_hook,
)
from xgrad.torch_backend.spawn import spawn


def test_builtin_hook_types_are_pytorchs_python_hooks_and_others_are_named() -> None:
    assert builtin_hook(dist.BuiltinCommHookType.ALLREDUCE) is default_hooks.allreduce_hook
    assert builtin_hook(dist.BuiltinCommHookType.FP16_COMPRESS) is default_hooks.fp16_compress_hook
    with pytest.raises(ValueError, match=r"comm_hook_type='BF16' is not one of"):
        builtin_hook("BF16")


def _bucket(*grads: torch.Tensor) -> GradBucket[torch.Tensor]:
    flat = torch.cat([g.reshape(-1) for g in grads])
    return GradBucket(0, flat, list(grads), [None] * len(grads), True)


def _hook(params: str = "state, bucket", **annotations: Any) -> Callable[..., Any]:
    """A hook with these parameters and *evaluated* annotations (this module postpones
    its own, which PyTorch's check would compare as text)."""
    namespace: dict[str, Any] = {}
    exec(f"def hook({params}):\n    return None", namespace)
    hook = namespace["hook"]
    hook.__annotations__ = annotations
    return hook


_FUTURE = torch.futures.Future[torch.Tensor]

HOOKS: dict[str, Any] = {
    "not_callable": 3,
    "plain": _hook(),
    "annotated": _hook(bucket=dist.GradBucket, **{"return": _FUTURE}),
    "other_names": _hook("s, b"),  # PyTorch reads the signature by the name "bucket"
    "varargs": _hook("*args"),
    "bucket_only": _hook("bucket"),  # too few: fails when called, as PyTorch's
    "three": _hook("state, bucket, extra"),
    "bucket_int": _hook(bucket=int),
    "bucket_any": _hook(bucket=Any),
    "return_int": _hook(**{"return": int}),
    "return_future": _hook(**{"return": torch.futures.Future}),
    "allreduce": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "fp16_wrapper": default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
}


def _outcome(check: Callable[[Any], None], hook: Any) -> str:
    try:
        check(hook)
    except Exception as err:
        return type(err).__name__
    return "accepted"


def _pytorchs_check(hook: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    ddp = SimpleNamespace(logger=None)  # all _check_comm_hook reads of the DDP
    ddp._log_and_throw = lambda kind, message: TorchDDP._log_and_throw(ddp, kind, message)
    TorchDDP._check_comm_hook(ddp, hook)


@pytest.mark.parametrize("name", HOOKS)
def test_a_hook_is_refused_or_accepted_as_pytorch_does(name: str) -> None:
    assert _outcome(check_comm_hook, HOOKS[name]) == _outcome(_pytorchs_check, HOOKS[name])


def test_refused_hooks_are_named_and_postponed_annotations_evaluated() -> None:
    with pytest.raises(TypeError, match="Communication hook must be callable, got 3"):
        check_comm_hook(3)
    with pytest.raises(KeyError) as missing:
        check_comm_hook(HOOKS["other_names"])
    assert missing.value.args[0] == (
        "Communication hook hook(s, b) has no parameter named 'bucket': "
        "expected hook(state, bucket: dist.GradBucket)"
    )
    with pytest.raises(ValueError, match=r"should be dist\.GradBucket; hook has <class 'int'>"):
        check_comm_hook(HOOKS["bucket_int"])

    # Text annotations (this module's own): PyTorch refuses even the right ones.
    def postponed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        raise AssertionError("never called")

    def postponed_any(state: Any, bucket: Any) -> Any:
        raise AssertionError("never called")

    assert _outcome(_pytorchs_check, postponed) == "ValueError"
    assert _outcome(check_comm_hook, postponed) == "accepted"
    assert _outcome(check_comm_hook, postponed_any) == "ValueError"  # Any is no GradBucket


def test_a_hook_that_returns_no_future_raises_pytorchs_error() -> None:
    def tensor_hook(state: Any, bucket: Any) -> Any:
        return bucket.buffer()

    def none_hook(state: Any, bucket: Any) -> Any:  # PyTorch's DDP crashes (SIGSEGV)
        return None

    for hook, kind in ((tensor_hook, "torch.Tensor"), (none_hook, "builtins.NoneType")):
        run = future_hook(lambda: None, hook, None)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match=rf"Future object, but got {kind} \(from "):
            run(_bucket(torch.ones(3)))


def test_a_channels_last_gradient_reaches_the_hook_row_major() -> None:
    grad = torch.arange(24.0).reshape(1, 2, 3, 4).to(memory_format=torch.channels_last)
    bucket = _bucket(torch.ones(2), grad)
    seen = _row_major(bucket).gradients()
    assert all(g.is_contiguous() for g in seen)
    assert seen[1].data_ptr() == bucket.buffer()[2:].data_ptr()  # a view, not a copy
    plain = _bucket(torch.ones(2), torch.ones(2, 3))
    assert _row_major(plain) is plain  # row-major already: the bucket itself


def _builtin_fp16(rank: int, world: int) -> bool:
    import copy

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    ref = copy.deepcopy(model)
    # a bucket per parameter: the buckets' hooks overlap on gloo (PyTorch's own hook)
    cap = 1e-5
    ours, theirs = (
        DistributedDataParallel(model, bucket_cap_mb=cap),
        TorchDDP(ref, bucket_cap_mb=cap),
    )
    ours._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    theirs._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    assert not ours.reducer.serial_hooks
    g = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(4, 5, generator=g) for _ in range(3)]
    return _same_steps(model, ref, ours, theirs, inputs, lambda y: y.square().sum())


def _same_steps(model: Any, ref: Any, ours: Any, theirs: Any, inputs: list[Any], loss: Any) -> bool:
    """Steps of SGD through both DDPs: whether every gradient was equal at every step."""
    equal = True
    for x in inputs:
        for m, d in ((model, ours), (ref, theirs)):
            m.zero_grad()
            loss(d(x)).backward()
        equal &= all(
            torch.equal(p.grad, q.grad)
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        )
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
    return equal


def test_only_pytorchs_compute_only_hooks_overlap_on_gloo() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    for hook in (
        default_hooks.allreduce_hook,
        default_hooks.fp16_compress_hook,
        default_hooks.bf16_compress_hook,
    ):
        assert callbacks_compute_only(hook)
    for hook in (
        powerSGD_hook.powerSGD_hook,
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
        lambda state, bucket: default_hooks.allreduce_hook(state, bucket),
    ):
        assert not callbacks_compute_only(hook)


def test_a_builtin_hook_gives_pytorchs_gradients() -> None:
    assert spawn(_builtin_fp16, 2, timeout=60) == [True, True]


def _tensor_returned(rank: int, world: int) -> list[tuple[bool, str]]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    # Unannotated: PyTorch's check refuses this module's (postponed) annotations.
    def tensor_hook(state, bucket):  # type: ignore[no-untyped-def]
        return bucket.buffer()

    out = []
    for cls in (DistributedDataParallel, TorchDDP):
        ddp = cls(torch.nn.Linear(3, 2))
        ddp.register_comm_hook(None, tensor_hook)
        try:
            ddp(torch.ones(2, 3)).sum().backward()
            out.append((False, "no error"))
        except Exception as err:
            out.append((isinstance(err, RuntimeError), str(err)))
    return out


def test_a_hook_returning_a_tensor_fails_the_backward_pass_as_pytorchs() -> None:
    needle = "must return a torch.futures.Future object, but got torch.Tensor"
    for ours, theirs in spawn(_tensor_returned, 2, timeout=60):
        assert ours[0] and theirs[0], (ours, theirs)
        assert needle in ours[1] and needle in theirs[1], (ours, theirs)


class _Complex(torch.nn.Module):
    """Two complex parameters (one bucket of complex64) and a real one (a bucket of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.complex64))
        self.v = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
        self.f = torch.nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ((x.to(torch.complex64) @ self.w) * self.v).abs().sum()
        return y + (self.f * x.sum(1, keepdim=True)).sum()


def _custom_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    """A user's hook: the buffer all-reduced by ``dist.all_reduce``, then averaged."""
    buffer = bucket.buffer()
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].div_(dist.get_world_size()))


def _complex_hooks(rank: int, world: int) -> dict[str, Any]:
    import copy

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from xgrad.torch_backend import DistributedDataParallel

    hooks = {
        "allreduce": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "fp16_wrapper": default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
        "custom": _custom_allreduce,
    }
    out: dict[str, Any] = {}
    for name, hook in hooks.items():
        torch.manual_seed(0)
        model = _Complex()
        ref = copy.deepcopy(model)
        seen: dict[str, list[Any]] = {"xgrad": [], "torch": []}

        def spy(side: str, hook: Any = hook, seen: Any = seen) -> Any:
            def run(state, bucket):  # type: ignore[no-untyped-def]
                buffer = bucket.buffer()
                seen[side].append((str(buffer.dtype), buffer.numel()))
                return hook(state, bucket)

            return run

        ours, theirs = DistributedDataParallel(model), TorchDDP(ref)
        ours.register_comm_hook(None, spy("xgrad"))
        theirs.register_comm_hook(None, spy("torch"))
        g = torch.Generator().manual_seed(rank)
        inputs = [torch.randn(4, 2, generator=g) for _ in range(2)]
        equal = _same_steps(model, ref, ours, theirs, inputs, lambda y: y)
        out[name] = (equal, seen["xgrad"] == seen["torch"], seen["xgrad"])
    return out


def test_complex_parameters_reach_a_hook_as_pytorchs_real_view_and_give_its_gradients() -> None:
    """PyTorch's reducer hands a hook a complex bucket as reals (two per number), so a
    hook that casts it keeps the imaginary parts. xgrad's buffer was complex: the fp16
    hook dropped the imaginary parts (the gradients went to NaN in a few steps) and a
    hook that all-reduced it failed (gloo returns the real view)."""
    for out in spawn(_complex_hooks, 2, timeout=90):
        for name, (equal, same_buffers, seen) in out.items():
            assert equal and same_buffers, (name, seen)
            assert ("torch.float32", 18) in seen, (name, seen)  # 6 + 3 complex numbers
