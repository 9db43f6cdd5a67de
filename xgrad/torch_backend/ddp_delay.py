"""DDP's ``delay_all_reduce_named_params``: some parameters reduced late, in one buffer.

PyTorch's DDP leaves these parameters out of its reducer, gives them gradients that are
views of one flat buffer, and when the gradient of ``param_to_hook_all_reduce`` is
computed divides the buffer by the world size and all-reduces it. PyTorch never waits
for that reduction (CUDA stream order does); here the end of the backward pass waits
for it, bounded by the DDP timeout, so the gradients are complete on gloo too.

PyTorch reduces the buffer at that gradient whether or not the delayed gradients are in
it: with a hooked parameter whose gradient comes before a delayed one's (a layer's bias
hooked, its weight delayed), a delayed gradient is added after (or while) the buffer is
reduced, and the ranks keep different, unaveraged gradients without a word. Here the
buffer is reduced at the hooked gradient when no delayed gradient of the pass is still to
come, and otherwise at the end of the pass, when every one that comes came. "Still to
come" asks autograd whether the parameter's accumulator is in this pass's graph, so a
delayed parameter this rank left out of its forward pass (unused here, used on another
rank) does not hold its reduction back: every rank reduces at the same point among the
bucket reductions. (Counting the arrived gradients against all delayed parameters put
that rank's reduction at the end of the pass, the others' at the hooked gradient: gloo
matched the buffer against a bucket of another size and aborted the process, where
PyTorch's DDP gives the mean.)

The buffer is made in the delayed parameters' dtype when they share one (PyTorch's is
made in the default dtype, so a float64 module's delayed gradients cannot be its views:
its DDP raises "attempting to assign a gradient with dtype 'float' to a tensor with
grad_dtype 'Double'", run here), else in the default dtype. A module converted behind
the DDP's back (``ddp.module.double()``) converts the delayed gradients too: no longer
views of the buffer, they were left out of its reduction, each rank keeping its own.
PyTorch 2.13 raises nothing there (gloo, 2 ranks: the delayed gradients differ between
the ranks from the conversion on, and so do its reducer's). Here every grad-enabled
forward pass compares the delayed parameters' dtypes with the buffer's (a C call for
them all) and refuses a mismatch on every rank through the failure channel, with the
:class:`~xgrad.reducer_errors.GradientDtypeError` of a converted module's bucketed
gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from xgrad.reducer_errors import GradientDtypeError
from xgrad.torch_backend.comm import CollectiveWork, TorchComm
from xgrad.torch_backend.ops import dtypes_of, first_other_dtype
from xgrad.torch_backend.weak_hooks import owned_by, weak_method


class DelayedAllReduce:
    """One flat gradient buffer for the delayed parameters, reduced at the hooked gradient.

    Args:
        params: the delayed parameters.
        names: their names (for the errors).
        hooked: the parameter whose gradient triggers the reduction.
        comm: the process group.
        device: where the buffer lives (PyTorch: ``device_ids[0]`` or the CPU).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        hooked: torch.nn.Parameter,
        comm: TorchComm,
        device: torch.device,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.comm = comm
        dtypes = {p.dtype for p in self.params}
        dtype = dtypes.pop() if len(dtypes) == 1 else None  # None: the default dtype
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), device=device, dtype=dtype)
        comm.broadcast_tensors([p.detach() for p in self.params], src=0)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self._work: CollectiveWork | None = None
        self._arrived: set[int] = set()  # ids of the delayed parameters added this pass
        self._late = False  # the hooked gradient came first: reduce at the end of the pass
        #: called before each reduction (the DDP's: its reducer's used-map sum goes first,
        #: :meth:`~xgrad.reducer_marks.GradientMarks.sum_used_map`).
        self.before_launch: Callable[[], None] | None = None
        arrive, reduce = weak_method(self._arrive), weak_method(self._reduce)
        self._handles = [p.register_post_accumulate_grad_hook(arrive) for p in params]
        self._handle = hooked.register_hook(reduce)
        # Gone with the DDP: a dropped one's reduction ran in every later backward pass.
        owned_by(self, [*self._handles, self._handle])

    def remove(self) -> None:
        """Take the hooks off the parameters (the DDP's ``_remove_autograd_hooks``)."""
        for handle in (*self._handles, self._handle):
            handle.remove()

    def _arrive(self, param: torch.Tensor) -> None:
        self._arrived.add(id(param))

    def _still_to_come(self) -> bool:
        """Whether a delayed gradient of this pass has not been added yet: one whose
        parameter has not arrived and whose accumulator this backward pass will run."""
        for p in self.params:
            if id(p) in self._arrived or not p.requires_grad:
                continue
            node = torch.autograd.graph.get_gradient_edge(p).node
            if torch._C._will_engine_execute_node(node):
                return True
        return False

    def _reduce(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._still_to_come():
            self._launch()
        else:
            self._late = True
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
        engine.queue_callback(self.wait)
        return grad

    def _launch(self) -> None:
        if self.before_launch is not None:
            self.before_launch()
        self.buffer.div_(self.comm.size)
        self._work = self.comm.allreduce(self.buffer)

    def wait(self) -> None:
        """End of the backward pass: launch the reduction if it was left for now, and wait
        for it (bounded)."""
        if self._late:
            self._late = False
            self._launch()
        self._arrived.clear()
        work, self._work = self._work, None
        if work is not None:
            work.wait()

    def wrong_dtype(self) -> GradientDtypeError | None:
        """The error for a delayed parameter whose dtype is no longer the buffer's (the
        module converted since the DDP was made: see the module docstring); ``None``
        when every one matches. Once a forward pass, not per gradient."""
        dtypes = dtypes_of(self.params)
        dtype = self.buffer.dtype
        k = first_other_dtype(dtypes, dtype)
        if k is None:
            return None
        return GradientDtypeError(
            f"The gradient of parameter {self.names[k]} in delay_all_reduce_named_params "
            f"is {dtypes[k]} but the buffer it is reduced in holds {dtype} on rank "
            f"{self.comm.rank}: the module's parameters were converted (module.double(), "
            ".half(), .to(dtype), perhaps of one submodule) after DistributedDataParallel "
            "was constructed, and that buffer keeps the dtype it was made in (PyTorch's "
            "leaves such gradients unreduced without a word). Convert the module before "
            "constructing DistributedDataParallel (all delayed parameters in one dtype), or "
            "leave the parameter out of delay_all_reduce_named_params."
        )

    def point_grads_at_buffer(self) -> None:
        """End of forward: gradients that are ``None`` become views of the buffer.

        When every gradient was ``None`` (``zero_grad(set_to_none=True)``) the buffer is
        zeroed once; otherwise the newly attached views are zeroed one by one.
        """
        self._arrived.clear()  # a pass the hooked gradient did not reach
        self._late = False
        all_none = all(p.grad is None for p in self.params)
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None:
                p.grad = view
                if not all_none:
                    view.zero_()
        if all_none:
            self.buffer.zero_()
