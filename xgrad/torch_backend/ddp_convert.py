"""A DDP converted after it was made: ``ddp.double()``, ``ddp.to(...)``.

PyTorch's reducer keeps the buckets it made and leaves each rank its local gradient then;
xgrad's kept them too, and reduced every later float64 gradient in a float32 bucket.
:class:`ConvertibleDDP` (mixed into the DDP) makes the buckets again for the parameters'
new dtype or device after ``nn.Module._apply``, which every conversion of the DDP goes
through. A conversion of its module alone does not: convert through the DDP.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ConvertibleDDP", "forget_bucket_memories"]


#: a comm hook state's per-bucket memories (PowerSGD's, PyTorch's and xgrad's): tensors
#: of the buckets' old dtype, which the re-made buckets cannot take.
_BUCKET_MEMORIES = ("error_dict", "p_memory_dict", "q_memory_dict")


def forget_bucket_memories(state: object) -> None:
    """After a conversion re-made the buckets: clear what the hook state kept per bucket
    (PowerSGD then starts its error feedback and warm start again). Kept, they met the
    new buckets as float32 tensors against float64 ones, and every step raised."""
    for name in _BUCKET_MEMORIES:
        memory = getattr(state, name, None)
        if isinstance(memory, dict):
            memory.clear()


class ConvertibleDDP(torch.nn.Module):
    """``_apply`` with the buckets following the parameters (see the module docstring)."""

    _agreement_pending: bool
    gradient_as_bucket_view: bool
    _grad_hooks: Any

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """The conversion, then the buckets made again where a parameter's dtype or
        device changed, the gradient views re-taken, and the hook state's per-bucket
        memories cleared (:func:`forget_bucket_memories`)."""
        out = super()._apply(fn, recurse)
        reducer = self.__dict__.get("reducer")  # None while __init__ moves the module
        if reducer is not None and reducer.relayout():
            self._agreement_pending = True
            if self.gradient_as_bucket_view:
                self._grad_hooks.alias_grads_to_buckets()
            forget_bucket_memories(self.__dict__.get("_hook_state"))
        return out
