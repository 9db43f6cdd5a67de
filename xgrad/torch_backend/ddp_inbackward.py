"""Optimizers run in the backward pass (``_apply_optimizer_in_backward``) under DDP.

``torch.distributed.optim._apply_optimizer_in_backward`` hangs a hook on each parameter's
gradient accumulator that steps the parameter's optimizers with the gradient it just
accumulated, then sets ``.grad`` to ``None``. Under DDP that gradient is this rank's own,
not the average: left alone, every rank would step on its own gradient and the replicas
would drift apart without a word. PyTorch's DDP, at its first forward pass, removes
those hooks from the parameters it reduces and registers a comm hook instead that
all-reduces each bucket, divides by the group's size, steps the optimizers of the
bucket's parameters with the averaged gradients and sets those gradients to ``None``
at the end of the backward pass. This module does the same for xgrad's DDP (where
PyTorch's own needs an accelerator stream, so it runs on CPU too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["setup_in_backward_optimizers"]


def setup_in_backward_optimizers(ddp: DistributedDataParallel) -> None:
    """Once, at the first forward pass: take over in-backward optimizers, as PyTorch does.

    Raises:
        RuntimeError: a comm hook is registered already (PyTorch: "can only be called
            once"; its in-backward optimizers support plain allreduce only).
    """
    ddp._lazy_init_ran = True
    stepped = [p for p in ddp._params if hasattr(p, "_in_backward_optimizers")]
    if not stepped:
        return
    from torch.distributed.optim import apply_optimizer_in_backward as applied

    for p in stepped:
        for handle in applied.param_to_optim_hook_handle_map.get(p, []):
            handle.remove()
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    queued = [False]

    def clear_grads() -> None:
        queued[0] = False
        for p in stepped:
            p.grad = None

    def allreduce_then_step(
        group: Any, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        # The all-reduce goes back as a future, so the reducer's bounded, watched wait is
        # the one that waits for it (a blocking call here would wait on gloo's timeout).
        buffer = bucket.buffer()
        size = dist.get_world_size(group)
        if not queued[0]:  # after the reducer's own end of pass, which writes .grad
            queued[0] = True
            engine.queue_callback(clear_grads)

        def step(_: torch.futures.Future[Any]) -> torch.Tensor:
            buffer.div_(size)
            for p, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                optimizers = getattr(p, "_in_backward_optimizers", None)
                if optimizers:
                    p.grad = grad
                    for optimizer in optimizers:
                        optimizer.step()
            return buffer

        work = dist.all_reduce(buffer, group=group, async_op=True)
        assert work is not None
        return work.get_future().then(step)

    ddp.register_comm_hook(None, allreduce_then_step)
