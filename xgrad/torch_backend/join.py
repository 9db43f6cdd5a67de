"""Uneven inputs: ``ddp.join()`` and PyTorch's ``Join``, shadowing the collectives of joined ranks.

A rank that ran out of inputs leaves the training loop; the others still run forward and
backward passes whose collectives need every rank. Inside ``with ddp.join():`` (or
``with Join([ddp, ...]):`` from ``torch.distributed.algorithms.join``) a rank that has
left keeps entering, per iteration of the others, the same collectives in the same
order, with zeros as its gradients, until every rank has left. Then all ranks adopt the
parameters of a rank that left last. The sequence, the same on both sides::

    still training (forward + backward)          joined (JoinHook.main_hook, repeated)
    allreduce(1): "I have not joined"            allreduce(0): count who has not joined
    [throw_on_early_termination: allreduce(0)]   [allreduce(1), then raise]
    buffers: allreduce(MAX rank) + broadcast     buffers: allreduce(-1) + broadcast
    announcement: this pass's flags, gathered    announcement: an empty row
    rebuild broadcast (once, gradients on)       rebuild broadcast (once, gradients on)
    plan agreement (when the plan changed)       plan agreement (when the plan changed)
                                                 the rest only if a reducing backward may follow
    round: GO at the backward's first hook       round: 0 (else the next forward pass, or end)
    bucket 0, 1, ... reduced in bucket order     bucket 0, 1, ... of zeros
    used-parameter map (find_unused_parameters) its last summed map (PyTorch's)

The announcement and the round (:mod:`.join_rounds`) let a forward pass go without a
backward pass (an evaluation under ``torch.no_grad()``, a validation loss with gradients
on) after a rank joined, where PyTorch's DDP aborts in gloo, and make ranks still
training that run different passes raise at once, naming them.

``divide_by_initial_world_size=False`` divides the gradients by the number of ranks
still training instead of the world size (PyTorch's ``div_factor``). Every wait is
bounded by the DDP's ``timeout``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.join import Joinable, JoinHook

from xgrad.torch_backend.ddp_recover import drop_unreduced, start_forward
from xgrad.torch_backend.join_rounds import close_round, counted, hear, notified, wait_round
from xgrad.torch_backend.lost_rank import transfer_failed

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp import DistributedDataParallel

__all__ = ["DDPJoinHook", "Join", "JoinHook", "Joinable", "JoinableDDP"]


def allreduce_tensor(
    ddp: DistributedDataParallel, t: torch.Tensor, what: str, op: Any = None
) -> torch.Tensor:
    """An allreduce of ``t`` on the DDP's private group, watched like its reductions."""
    group = ddp.comm.group
    work = dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group, async_op=True)
    ddp._watch.wait_work(work, what, t.is_cuda)
    return t


def _allreduce(ddp: DistributedDataParallel, value: float, op: Any = None) -> torch.Tensor:
    """A one-element allreduce on the DDP's group, waited on with its timeout."""
    return allreduce_tensor(
        ddp, torch.tensor([value], device=ddp.join_device), "join allreduce", op
    )


class Join(TorchJoin):
    """PyTorch's join context manager with its own collectives bounded by a timeout.

    Same arguments and behaviour as ``torch.distributed.algorithms.join.Join``; PyTorch's
    waits without a bound on the allreduce that counts the ranks still training, here it
    is the first joinable's ``timeout`` (or the group's when it has none).
    """

    def __init__(
        self,
        joinables: list[Joinable],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(joinables, (list, tuple)):
            raise TypeError(f"joinables must be a list of Joinable, got {type(joinables).__name__}")
        for j in joinables:
            if not isinstance(j, Joinable):
                raise TypeError(f"{type(j).__name__} is not a Joinable (no join_hook)")
        super().__init__(list(joinables), enable, throw_on_early_termination, **kwargs)
        self._timeout = getattr(joinables[0], "timeout", None) if joinables else None
        # The first joinable's step watch (a DDP's): its failure channel names a peer
        # that failed, died or froze while this rank counts the ranks still training.
        self._watch = getattr(joinables[0], "_watch", None) if joinables else None

    def _all_reduce(self, value: float) -> float:
        t = torch.full((1,), value, device=self._device)
        try:
            work = dist.all_reduce(t, group=self._process_group, async_op=True)
            if self._timeout is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=self._timeout))
        except RuntimeError as exc:  # gloo: a peer died, or the wait ran out
            if self._watch is None:
                raise
            what = "join, counting the ranks still training"
            raise transfer_failed(self._watch.channel, what, exc, None) from exc
        return float(t.item())

    def _get_num_nonjoined_procs(self) -> float:
        hooks = [h for h in self._join_hooks if isinstance(h, DDPJoinHook)]
        for hook in hooks:  # before the count, as the others' forward does it
            hook.drop_failed_step()
        total = self._all_reduce(0.0)
        for hook in hooks:  # left with a round open: the count was this rank's part
            counted(hook.ddp, total)
        return total

    def _notify_procs_to_terminate(self) -> None:
        self._all_reduce(1.0)
        raise RuntimeError(f"Rank {self._rank} exhausted all inputs.")


class JoinableDDP(Joinable):
    """The ``Joinable`` members of the DDP, with PyTorch's names and defaults."""

    timeout: float
    process_group: Any

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """A context in which ranks may run out of inputs at different iterations.

        Args:
            divide_by_initial_world_size: divide gradients by the world size (``True``,
                PyTorch's default) or by the number of ranks still training.
            enable: ``False`` turns the context into a no-op (inputs known to be even).
            throw_on_early_termination: raise on every rank as soon as one runs out,
                instead of shadowing its collectives.

        Example:
            >>> with ddp.join():  # doctest: +SKIP
            ...     for x in my_shard:          # lengths differ between ranks
            ...         ddp(x).sum().backward()
        """
        for name, flag in (
            ("divide_by_initial_world_size", divide_by_initial_world_size),
            ("enable", enable),
            ("throw_on_early_termination", throw_on_early_termination),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"join(): {name} must be a bool, got {flag!r}")
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        """The hook a join context runs for this DDP once its rank has no input left.

        Takes ``divide_by_initial_world_size`` (default ``True``), as PyTorch's does.
        """
        unknown = set(kwargs) - {"divide_by_initial_world_size"}
        if unknown:
            raise TypeError(f"join_hook() got unexpected keyword arguments {sorted(unknown)}")
        if getattr(self, "_delayed", None) is not None:
            # A joined rank cannot know where in the others' backward pass their delayed
            # all-reduce comes (PyTorch's DDP aborts the process in gloo there).
            raise ValueError(
                "join() does not support delay_all_reduce_named_params: a rank that has "
                "joined cannot match the delayed all-reduce of the ranks still training"
            )
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))  # type: ignore[arg-type]

    @property
    def join_device(self) -> torch.device:
        """Where the join context's one-element collectives live (the parameters' device)."""
        return self._params[0].device  # type: ignore[attr-defined, no-any-return]

    @property
    def join_process_group(self) -> Any:
        """The group the join context counts ranks over (the DDP's own)."""
        return self.process_group


class DDPJoinHook(JoinHook):
    """What a rank that has run out of inputs does for each iteration of the others.

    Args:
        ddp: xgrad's :class:`~xgrad.torch_backend.DistributedDataParallel`.
        divide_by_initial_world_size: divide gradients by the world size (``True``) or
            by the number of ranks still training.
    """

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        if not isinstance(divide_by_initial_world_size, bool):
            raise TypeError(
                f"divide_by_initial_world_size must be a bool, got {divide_by_initial_world_size!r}"
            )
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        #: this rank's last pass left buckets unreduced: raised when the join ends.
        self.failed: BaseException | None = None
        super().__init__()

    def drop_failed_step(self) -> None:
        """If this rank's last pass left buckets unreduced, drop that step now, as the
        ranks still training do at the forward pass where they raise it (they drop it
        first, in step: a fresh group made by all); raised here when the join ends, since
        raising now would leave them waiting for this rank in their next steps."""
        ddp = self.ddp
        failed = drop_unreduced(
            ddp._grad_hooks, lambda: start_forward(ddp._watch, ddp._grad_hooks, True, joining=True)
        )
        if failed is not None:
            self.failed = failed

    def main_hook(self) -> None:
        """Enter the collectives of one forward pass of the others and of the backward
        pass that follows it, or of the next forward pass when none did (join_rounds)."""
        ddp = self.ddp
        ddp._grad_hooks.join_round = None  # left join() in a round: its count was its part
        while True:
            ddp._check_and_sync_module_buffers()  # from a rank still training (ddp_buffers)
            heard = hear(ddp)
            if heard.grad and ddp.reducer.rebuild_buckets():  # as in forward: compared again
                ddp._agreement_pending = True
                if ddp.gradient_as_bucket_view:
                    ddp._grad_hooks.alias_grads_to_buckets()
            ddp.require_forward_param_sync = heard.param_sync
            if not heard.reduce:
                return
            # The ranks still training began a step at this forward pass: begin it here
            # too, so what fails in the shadow pass (a comm hook) is posted where they look.
            start_forward(ddp._watch, ddp._grad_hooks, True, joining=True)
            if heard.param_sync:
                ddp._check_agreement()
            if ddp._join_config.is_first_joinable:
                then = wait_round(ddp, heard.training)
                if then == "forward":
                    continue
                if then == "left":
                    return
            break
        ddp.reducer.shadow_backward(sparse_zero=_empty_sparse_gradient)
        if ddp.reducer.needs_rebuild_order():
            # Never trained (or not through a whole iteration): offer the definition
            # order, so this rank can take part in the rebuild the others do next.
            ddp.reducer.offer_rebuild_order(range(len(ddp.reducer.params)))

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters (and buffers) of a rank that joined last."""
        close_round(self.ddp)
        sync_final_model(self.ddp, is_last_joiner)
        failed, self.failed = self.failed, None
        if failed is not None:
            raise failed


def _empty_sparse_gradient(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient with no entries, laid out as an embedding's (one sparse dimension).

    Only ``nn.Embedding`` and ``nn.EmbeddingBag`` make sparse gradients; gloo sums sparse
    tensors by gathering every rank's entries, so this one adds nothing.
    """
    indices = torch.empty((1, 0), dtype=torch.int64, device=param.device)
    values = torch.empty((0, *param.shape[1:]), dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape)


def find_common_rank(ddp: DistributedDataParallel, rank: int, candidate: bool) -> int:
    """The largest rank among the candidates (PyTorch's ``_find_common_rank``)."""
    found = int(_allreduce(ddp, rank if candidate else -1, dist.ReduceOp.MAX).item())
    if found < 0:
        raise RuntimeError(
            f"join: no rank offered itself as the authoritative copy (seen on rank {rank})"
        )
    return found


def sync_final_model(ddp: DistributedDataParallel, is_last_joiner: bool) -> None:
    """Broadcast the parameters and buffers of the largest rank that joined last."""
    from xgrad.torch_backend.sync import broadcast_state

    src = find_common_rank(ddp, ddp.comm.rank, is_last_joiner)
    broadcast_state(
        ddp.comm,
        ddp.module,
        buffers=ddp.forward_sync_buffers,
        ignore=ddp.parameters_to_ignore,
        src=src,
    )


def notify_join_context(ddp: DistributedDataParallel) -> int | None:
    """Tell a joined rank's context that this one still trains; the ranks still training.

    Called at the start of every forward pass inside an enabled join context (by the
    first joinable only, as PyTorch does). Returns the number of ranks still training
    when the gradients are to be divided by it, else ``None``.
    """
    # A round left open (join_rounds): this forward pass's all-reduce is this rank's part
    # of it, else (the context gone) no backward pass enters it any more.
    pending, ddp._grad_hooks.join_round = ddp._grad_hooks.join_round, None
    config = ddp._join_config
    if not (config.enable and config.is_first_joinable):
        return None
    # These two pair with the join context's own, on the join group (not the private one).
    ones = torch.ones(1, device=ddp.join_device)
    work = dist.all_reduce(ones, group=ddp.process_group, async_op=True)
    if config.throw_on_early_termination:
        zeros = torch.zeros(1, device=ddp.join_device)
        check = dist.all_reduce(zeros, group=ddp.process_group, async_op=True)
    if pending is not None:  # before the throw check: one that went back raised already
        ddp._watch.wait_work(work, "join: the backward pass's round", ones.is_cuda)
        training = notified(ddp, pending, ones.item())
    if config.throw_on_early_termination:
        check.wait(timedelta(seconds=ddp.timeout))
        if zeros.item():
            raise RuntimeError(
                "Detected at least one rank that exhausted inputs. Throwing across all ranks."
            )
    if pending is not None:
        return None if ddp._divide_by_initial_world_size else training
    if ddp._divide_by_initial_world_size:
        return None
    work.wait(timedelta(seconds=ddp.timeout))
    return int(ones.item())
