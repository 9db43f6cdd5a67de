"""The module's buffers across ranks: PyTorch DDP's broadcast, or the user's buffer hook.

What PyTorch 2.13's DDP does with buffers, kept here because each part, missed, gives
silently different numbers on different ranks:

- The list of buffers is taken again at every sync (PyTorch's ``_assign_modules_buffers``):
  a module may *reassign* a buffer (``self.running_mean = new``), and broadcasting the
  old tensor would leave the new one differing between ranks (pytorch/pytorch#63916).
- The broadcast hides its in-place write from autograd (the version counters are kept):
  a buffer that a previous forward pass saved for its backward (``x * self.scale``,
  two forward passes before one backward) is not reported as modified.
- A buffer communication hook (``_register_buffer_comm_hook``) replaces the broadcast,
  before or after the forward pass as registered, and the futures it returns are waited
  for (bounded, watched) at the end of the backward pass, as PyTorch's reducer does; a
  forward pass that starts no backward pass waits for them at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from xgrad.torch_backend.ddp_watched import WatchedFuture
from xgrad.torch_backend.join_final import find_common_rank

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["BufferSyncDDP", "first_pass_regrouped", "sync_buffers"]


@contextlib.contextmanager
def _versions_kept(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Autograd does not see these tensors change inside (one tensor per context: the
    tuple form is newer than the oldest PyTorch supported)."""
    with contextlib.ExitStack() as stack:
        for t in tensors:
            stack.enter_context(torch.autograd._unsafe_preserve_version_counter(t))
        yield


def sync_buffers(
    ddp: DistributedDataParallel, src: int | None = None, discard: bool = False
) -> None:
    """Sync the buffers from group rank ``src`` (default: rank 0, or under ``join()`` the
    last rank still training), or through the registered buffer hook.

    ``discard``: the same collectives into copies, thrown away. A pass stood in for under
    ``join()`` (:mod:`.join_absent`) sends them only to meet the joined rank's shadow: the
    DDP ran no pass, so its buffers stay as they are, and its next real pass broadcasts
    those of the highest rank still training then (a stood-in broadcast kept would hand
    the buffers of a rank that joined since to the rank that broadcasts next)."""
    ddp._assign_modules_buffers()  # a buffer the module reassigned since (PyTorch's)
    hook = getattr(ddp, "buffer_hook", None)
    if hook is None and ddp.comm.size == 1:
        return
    named = ddp.named_module_buffers
    if discard:
        named = {name: t.detach().clone() for name, t in named.items()}
    buffers = list(named.values()) if discard else ddp.modules_buffers
    with _versions_kept(buffers):
        if hook is not None:
            futures = hook.buffer_comm_hook(hook.buffer_comm_hook_state, named)
            if futures is not None:
                pending = ddp._grad_hooks.buffer_futures
                pending += [WatchedFuture(f, ddp._watch, "buffer comm hook") for f in futures]
            return
        if src is None:
            src = find_common_rank(ddp, ddp.comm.rank, True) if ddp._join_config.enable else 0
        with torch.no_grad():
            ddp.comm.broadcast_tensors(buffers, src=src)


def first_pass_regrouped(ddp: DistributedDataParallel, buffers: bool = True) -> None:
    """At the first pass of the step after a failed one (the fresh group made, the watch's
    ``regrouped`` set), on every rank alike: the flag consumed, the ranks' agreement
    compared again at the step's synchronised pass (whether a rank had finished the failed
    step's agreement depends on when it read the failure: one whose all-gather completed
    kept it pending while a peer had cleared it, and at the next step one all-gathered
    while the other reduced, to the timeout), and (``buffers``) the buffers synced at this
    pass (where the DDP syncs them), whatever the last pass left. Whether a rank's last
    pass reached its end (which sets that flag) depends on where and when the step failed
    on it: one whose ``no_sync`` forward raised in the module kept a synchronised pass's
    flag while its peers kept theirs, and one rank broadcast the buffers while the others
    did not (a broadcast paired with the next collective: a gloo abort, exit -6). Synced,
    the replicas also agree again on what the failed step left in them (running
    statistics of a pass some ranks ran). Nothing where the step did not follow a failed
    one."""
    if not ddp._watch.regrouped:
        return
    ddp._watch.regrouped = False
    ddp._agreement_pending = True
    if buffers:
        ddp.require_forward_param_sync = True


class BufferSyncDDP:
    """Mixed into the DDP: PyTorch's buffer methods, on the watched communicator."""

    def _sync_buffers(self) -> None:
        sync_buffers(self)  # type: ignore[arg-type]

    def _sync_module_buffers(self, authoritative_rank: int) -> None:
        sync_buffers(self, authoritative_rank)  # type: ignore[arg-type]

    def _check_and_sync_module_buffers(self) -> None:
        """Under ``join()``: the buffers of a rank that agreed, if buffers sync now."""
        ddp: Any = self
        if ddp._check_sync_bufs_pre_fwd():
            sync_buffers(ddp, find_common_rank(ddp, ddp.comm.rank, False))

    def _find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        return find_common_rank(self, input_rank, rank_cond)  # type: ignore[arg-type]

    def _default_broadcast_coalesced(
        self,
        bufs: Sequence[torch.Tensor] | None = None,
        bucket_size: int | None = None,
        authoritative_rank: int = 0,
    ) -> None:
        ddp: Any = self
        tensors = ddp.modules_buffers if bufs is None else bufs
        self._distributed_broadcast_coalesced(tensors, bucket_size, authoritative_rank)

    def _distributed_broadcast_coalesced(
        self, tensors: Sequence[torch.Tensor], buffer_size: int | None, authoritative_rank: int = 0
    ) -> None:
        """Overwrite ``tensors`` with group rank ``authoritative_rank``'s values (one
        watched broadcast per dtype; ``buffer_size`` is PyTorch's chunking, not needed)."""
        ddp: Any = self
        with torch.no_grad():
            ddp.comm.broadcast_tensors(list(tensors), src=authoritative_rank)

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        from xgrad.torch_backend.join_final import sync_final_model

        sync_final_model(self, is_last_joiner)  # type: ignore[arg-type]
