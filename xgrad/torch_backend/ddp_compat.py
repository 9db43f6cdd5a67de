"""PyTorch DDP's remaining reducer-facing methods, on xgrad's reducer.

The DDP subclasses PyTorch's class without building its C++ reducer, so a method of that
class which would reach ``self.reducer`` (a C++ object there) is answered here or in the
other mixins, with PyTorch's checks and wording. The few that have no counterpart raise
``NotImplementedError`` saying so, instead of an ``AttributeError`` from deep inside
PyTorch's code: the join hook's internals (xgrad's ``join()`` runs its own shadow pass,
:mod:`.join`) and the sparse-index remapping of ``_set_sparse_metadata``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompatDDP"]


class CompatDDP:
    """Mixed into the DDP: ``_check_reducer_finalized``, the logging sample rate,
    ``_update_process_group``, and the methods without a counterpart."""

    #: PyTorch's default (``kDDPRuntimeLoggingSampleRate``).
    _runtime_logging_sample_rate = 100

    @property
    def broadcast_buffers(self) -> bool:
        """PyTorch 2.13's alias of ``forward_sync_buffers``, defined here too: the methods
        inherited from an older PyTorch (``will_sync_module_buffers`` before 2.13) read
        ``broadcast_buffers``, which there is an attribute of its own constructor."""
        ddp: Any = self
        return bool(ddp.forward_sync_buffers)

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        ddp: Any = self
        ddp.forward_sync_buffers = value

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """Whether the buckets were rebuilt from an observed order (PyTorch's flag, read by
        its ZeRO overlap hook); set to False, they are rebuilt again at the next pass."""
        ddp: Any = self
        return bool(ddp.reducer.has_rebuilt_buckets)

    @_has_rebuilt_buckets.setter
    def _has_rebuilt_buckets(self, value: bool) -> None:
        ddp: Any = self
        ddp.reducer.has_rebuilt_buckets = bool(value)

    def _check_reducer_finalized(self) -> None:
        """Raise if the last synchronised backward pass left gradients unreduced.

        Raises:
            RuntimeError: PyTorch's "Expected to have finished reduction in the prior
                iteration" error, naming the parameters that got no gradient on this rank.
        """
        ddp: Any = self
        ddp.reducer.check_finalized()

    def _remove_autograd_hooks(self) -> None:
        """Take this DDP's gradient hooks off the parameters (PyTorch's; its tests call it
        before another DDP wraps the same module while this one is alive): a backward
        pass reduces nothing for this DDP after."""
        ddp: Any = self
        hooks = ddp._grad_hooks
        hooks.arrivals.enabled = False
        for handle in hooks.handles:
            handle.remove()
        hooks.handles = []
        if ddp._delayed is not None:
            ddp._delayed.remove()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Refresh ``_get_ddp_logging_data``'s runtime keys every ``sample_rate``
        iterations after the first 10, as PyTorch samples them (``ddp_logging``); xgrad's
        own ``timeline`` records every iteration.

        Raises:
            ValueError: ``sample_rate`` below 1 (PyTorch's check).
        """
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < 1:
            raise ValueError(
                f"DDP runtime logging sample rate should be equal or greater than 1, "
                f"got {sample_rate!r}"
            )
        self._runtime_logging_sample_rate = sample_rate

    def _update_process_group(self, new_process_group: Any) -> None:
        """Reduce over ``new_process_group`` from the next iteration on (PyTorch's; a
        fault-tolerant trainer's replaced group).

        The reducer starts over (a pass under way dropped, the buckets rebuilt from the
        next pass's ready order over the new group, the divisor its size), and the step
        watch starts over on the new group (a private group and failure channel of its
        own). The watch and the communicator are re-initialised in place, not replaced:
        the reducer, the gradient hooks, registered comm hooks, a delayed all-reduce and
        mixed precision's hook hold them and all move with them. A rank outside the new
        group only resets its reducer, as PyTorch's does.
        """
        from torch.distributed.distributed_c10d import _rank_not_in_group

        ddp: Any = self
        if not _rank_not_in_group(new_process_group):
            ddp.process_group = new_process_group
            ddp._watch.__init__(new_process_group, ddp.timeout)
            ddp.comm.__init__(ddp._watch)
            ddp._agreement_pending = True  # plan and parameters compared on the new group
        ddp.reducer.reset_state()

    def _set_sparse_metadata(self, global_unique_ids: dict[str, Any]) -> None:
        raise NotImplementedError(
            "xgrad's DistributedDataParallel does not remap sparse gradients' indices "
            "(_set_sparse_metadata); sparse gradients are reduced as PyTorch does without it"
        )

    def _match_all_reduce_for_bwd_pass(self) -> None:
        raise NotImplementedError(_JOIN_INTERNAL.format("_match_all_reduce_for_bwd_pass"))

    def _match_unused_params_allreduce(self) -> None:
        raise NotImplementedError(_JOIN_INTERNAL.format("_match_unused_params_allreduce"))


_JOIN_INTERNAL = (
    "{} is an internal step of PyTorch's join hook; xgrad's DistributedDataParallel.join() "
    "runs its own shadow pass (xgrad.torch_backend.join)"
)
