"""DDP's steps after the wrapped module's forward pass, outside dynamo's view.

Read the announcement sent before the module ran (under ``join()``), sync the buffers
where a hook runs after the forward pass, then, for a pass with gradients on: find the
parameters the output does not reach (``find_unused_parameters``) and prepare the reducer
for the backward pass, or (a ``no_sync`` pass) note that none reduces. Split from
:mod:`.ddp_forward`, which runs before the module and calls this through its
``torch._dynamo.disable``-d method.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from xgrad.raising import raise_from
from xgrad.torch_backend.autograd_graph import find_unused_parameters, grad_accumulators
from xgrad.torch_backend.ddp_buffers import sync_buffers
from xgrad.torch_backend.ddp_recover import reduces_unsynced
from xgrad.torch_backend.ddp_sink import route_outputs
from xgrad.torch_backend.join_rounds import read_announcement

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["post_forward"]

#: per DDP searching for unused parameters: its parameters' accumulators (see
#: :func:`~xgrad.torch_backend.autograd_graph.grad_accumulators`), held while it lives.
_ACCUMULATORS: weakref.WeakKeyDictionary[Any, dict[Any, int]] = weakref.WeakKeyDictionary()


def post_forward(ddp: DistributedDataParallel, output: Any) -> Any:
    """Everything DDP does after the module ran; returns the output (routed: ddp_sink)."""
    read_announcement(ddp)  # under join(), sent before the module ran (join_rounds)
    if ddp._check_sync_bufs_post_fwd():  # a buffer hook registered to run after
        sync_buffers(ddp)
    if ddp._delayed is not None and torch.is_grad_enabled():
        # Before the reducer is prepared: refused as a forward pass's failure, on every
        # rank, where the delayed gradients would go unreduced (ddp_delay).
        wrong = ddp._delayed.wrong_dtype()
        if wrong is not None:
            raise_from(ddp._forward_failed(wrong), wrong)
    hooks = ddp._grad_hooks
    if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
        ddp.require_forward_param_sync = True
        unused: Sequence[int] = ()
        if ddp.find_unused_parameters and not ddp.static_graph:
            accumulators = _ACCUMULATORS.get(ddp)
            if accumulators is None:  # held from the first search on, as PyTorch's reducer does
                accumulators = _ACCUMULATORS[ddp] = grad_accumulators(ddp._params)
            unused = find_unused_parameters(
                output, ddp._param_index, len(ddp._params), accumulators
            )
            output = route_outputs(output)  # a loss may leave outputs out (PyTorch's sink)
        ddp.reducer.prepare_for_backward(unused, divisor=ddp._still_training)
        _expect_backward(ddp)
    elif torch.is_grad_enabled() and not hooks.accumulating and reduces_unsynced(hooks):
        # A no_sync pass after a synchronised forward pass that every rank left without
        # a backward: the reducer, still prepared for it, reduces this pass (PyTorch's).
        ddp.require_forward_param_sync = False
        _expect_backward(ddp, unsynced=True)
    else:
        ddp.require_forward_param_sync = False
        hooks.wait_buffer_futures()  # no reducing backward pass to wait for them
        hooks.nosync_pending = torch.is_grad_enabled()
        hooks.forward_thread = threading.get_ident()  # whose backward call notes its failure
    if ddp._delayed is not None:
        ddp._delayed.point_grads_at_buffer()
    return output


def _expect_backward(ddp: DistributedDataParallel, unsynced: bool = False) -> None:
    hooks = ddp._grad_hooks
    hooks.expect_backward(unsynced)
    hooks.forward_started = ddp._forward_started
    hooks.forward_seconds = time.perf_counter() - ddp._forward_started
