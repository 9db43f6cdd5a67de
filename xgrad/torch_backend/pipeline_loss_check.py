"""The call of a pipeline's loss on the last stage's output, checked where it starts the
backward (:func:`checked_loss`).

Moved out of :mod:`~xgrad.torch_backend.pipeline_stage_base` (which grew past the style's
split point): the checks read only the loss, the output and its target, and the batch dim,
none of the step's state, and fail with the shapes that tell a wrong target from a wrong
loss. ``StageState._loss`` calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from xgrad.torch_backend.pipeline_wire import tensor_leaves

__all__ = ["checked_loss"]


def checked_loss(
    loss_fn: Callable[..., Any],
    y: Any,
    target: Any,
    loss_kwargs: dict[str, Any] | None,
    batch_dim: int | None,
) -> torch.Tensor:
    """``loss_fn(y, target)``, its failure naming the two shapes (a target batch that
    does not match the inputs' ends there, in a broadcast error); it must be a
    floating-point scalar tensor that requires a gradient. The output's batch is along
    dim 0, or the ``output_merge_spec``'s dim (unknown with other specs alone)."""
    dim = batch_dim
    if (
        dim is not None
        and isinstance(y, torch.Tensor)
        and isinstance(target, torch.Tensor)
        and -y.dim() <= dim < y.dim()
        and target.dim() > 0
        and y.shape[dim] != target.shape[0]
    ):
        # A loss that broadcasts (mse_loss over (1, 4) and (2, 4)) would not say it.
        rows = "rows" if dim == 0 else f"along dim {dim} (output_merge_spec)"
        raise ValueError(
            f"loss_fn(output, target): the microbatch's output has {y.shape[dim]} {rows} "
            f"and its target {target.shape[0]}: inputs and targets must have the same "
            f"batch size ({_shapes(y, target)})"
        )
    try:
        loss = loss_fn(y, target, **(loss_kwargs or {}))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise type(exc)(f"loss_fn(output, target): {exc} ({_shapes(y, target)})") from exc
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"loss_fn returned a {type(loss).__name__} ({loss!r}), not a tensor: the "
            "backward pass starts from it"
        )
    # Refused here, where they start, rather than as autograd's words in the backward.
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
    if not (loss.is_floating_point() or loss.is_complex()):
        raise TypeError(f"loss_fn must return a floating-point scalar, got {loss.dtype}")
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise ValueError(
            "loss_fn returned a loss that does not require a gradient (a constant, or "
            "one detached from the stage's output): the backward pass starts from it"
        )
    return loss


def _shapes(y: Any, target: Any) -> str:
    """``output shape (...); target shape (...)`` for the tensor leaves of each."""

    def of(tree: Any) -> str:
        return ", ".join(str(tuple(t.shape)) for t in tensor_leaves(tree)) or "no tensor"

    return f"output shape {of(y)}; target shape {of(target)}"
