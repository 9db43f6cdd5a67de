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

Under xgrad's own ``Join`` the announcement rides in the count (one all-reduce on the join
group: the count, then every rank's flags; :func:`~.join_announce.carried`), so a step
sends two collectives of ``join()``'s, as PyTorch's DDP does; under PyTorch's ``Join``,
whose count is one element, it goes on its own, on the DDP's group.

The announcement and the round (:mod:`.join_rounds`) let a forward pass go without a
backward pass (an evaluation under ``torch.no_grad()``, a validation loss with gradients
on) after a rank joined, where PyTorch's DDP aborts in gloo, and make ranks still
training that run different passes raise at once, naming them. A step that fails on a
rank still training is raised there at once; a rank that has joined keeps shadowing the
steps after it and raises it as it leaves ``join()`` (:mod:`.join_hook`), or at once
where a rank still training raised it out of xgrad's ``Join`` (:mod:`.join_leave`;
PyTorch's ``Join`` runs no hook then: its joined ranks raise at the DDP's timeout). With
several DDPs in one context, once a rank has joined, each DDP's backward pass must come
before the next DDP's forward pass, or every rank raises at once (:mod:`.join_order`);
DDPs that run different numbers of passes (gradient accumulation in one only) are
stood in for where they run none (:mod:`.join_absent`); a ``no_sync`` pass that raises
in any of them gives up the whole iteration on its rank (:mod:`.join_given_up`). The
hooks of joinables that are not DDPs (an optimizer's) run once per step of the first DDP
(:mod:`.join_others`).

``divide_by_initial_world_size=False`` divides the gradients by the number of ranks
still training instead of the world size (PyTorch's ``div_factor``). Every wait is
bounded by the DDP's ``timeout``.

This module is the context and the DDP's ``Joinable`` members; the side of the ranks
still training at each forward pass is :mod:`.join_notify`'s, the joined rank's
:mod:`.join_hook`'s.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.join import Joinable, JoinHook

from xgrad.failure import RankError
from xgrad.torch_backend import join_rounds
from xgrad.torch_backend.join_absent import stand_in_absent
from xgrad.torch_backend.join_announce import carried, count, heard
from xgrad.torch_backend.join_hook import DDPJoinHook
from xgrad.torch_backend.join_leave import wait_count
from xgrad.torch_backend.join_order import JoinOrder
from xgrad.torch_backend.join_others import once_per_step
from xgrad.torch_backend.join_refused import again
from xgrad.torch_backend.join_rounds import counted, failed_count
from xgrad.torch_backend.lost_rank import transfer_failed

if TYPE_CHECKING:
    pass

__all__ = ["DDPJoinHook", "Join", "JoinHook", "Joinable", "JoinableDDP"]


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
        join_rounds.counting(self._joinables)  # its count is read by a rank that leaves in a round
        self._order = JoinOrder(self._joinables, self._join_hooks)  # (its DDPs' forward passes)
        once_per_step(self._join_hooks, self._joinables, self._order)  # (an optimizer's)
        self._timeout = getattr(joinables[0], "timeout", None) if joinables else None
        # The first joinable's step watch (a DDP's): its failure channel names a peer
        # that failed, died or froze while this rank counts the ranks still training.
        self._watch = getattr(joinables[0], "_watch", None) if joinables else None

    def __exit__(self, type: Any, value: Any, traceback: Any) -> None:
        """PyTorch's, after telling the joined ranks when an exception leaves the block
        in a step that failed (:mod:`.join_leave`; PyTorch's ``Join`` cannot), a backward
        pass of this rank's that it cut short posted first (else the peers named this
        rank as one that stopped answering, not its exception). A block
        left plainly after a refusal that ended the context here, caught inside it, is
        left raising that refusal (:mod:`.join_refused`): the joined ranks are gone."""
        refused = self._order.standing() if self._enable and type is None else None
        hooks = [h for h in self._join_hooks if isinstance(h, DDPJoinHook)]
        if self._enable and (type is not None or refused is not None):
            # Best effort: the exception leaving the block is what this rank raises (a
            # group the user aborted in its handler takes no part in a round). All posted
            # first: another DDP's no_sync pass gives up the first DDP's step too.
            for hook in hooks if type is not None else ():
                with contextlib.suppress(Exception):
                    hook.post_cut_short()
            for hook in hooks:
                with contextlib.suppress(Exception):
                    hook.leave_raising()
            self._order.left_refused()
        if refused is not None:
            self._order.forget()
            raise again(refused)
        if self._enable and type is None:
            # Its last iteration's DDPs after the last one that ran (none ran after it
            # there: d3 skipped after d1, d2), stood in for before this rank counts, as
            # the ranks still training do at the next forward pass (join_absent), after
            # posting a backward pass of its own that raised, which decides them there.
            for hook in hooks:
                hook.post_cut_short()
            stand_in_absent(self._order)
        try:
            super().__exit__(type, value, traceback)
        finally:
            self._order.forget()  # (after the counts: a joined rank reads it there)
        kept, self._order.kept = self._order.kept, None  # (join_hook's post hooks)
        if kept is not None:
            raise kept

    def _between(self) -> None:
        """Between naps of the count: DDPs out of order; a no_sync pass's failure (join_hook)."""
        self._order.refuse()
        for hook in (h for h in self._join_hooks if isinstance(h, DDPJoinHook)):
            hook.drop_failed_step()

    def _all_reduce(self, value: float) -> float:
        t = torch.full((1,), value, device=self._device)
        self._sum(t)
        return float(t.item())

    def _sum(self, t: torch.Tensor) -> None:
        try:
            work = dist.all_reduce(t, group=self._process_group, async_op=True)
            if self._timeout is None:
                work.wait()
            elif self._watch is None:
                work.wait(timedelta(seconds=self._timeout))
            else:  # (join_leave: notes of ranks that left raising, and _between)
                wait_count(self._watch, work, self._timeout, self._between, self._order.entered)
        except RankError:
            raise
        except RuntimeError as exc:  # gloo: a peer died, or the wait ran out
            if self._watch is None:
                raise
            what = "join, counting the ranks still training"
            raise transfer_failed(self._watch.channel, what, exc, None) from exc

    def _count(self) -> float:
        """This rank's count of the ranks still training (0: it has joined); where the
        first joinable's announcement rides in it (join_announce), kept for its hook."""
        first: Any = self._joinables[0] if self._joinables else None
        if first is None or not carried(first):
            return self._all_reduce(0.0)
        t = count(first, 0.0)
        self._sum(t)
        heard(first, t)
        return float(t[0].item())

    def _get_num_nonjoined_procs(self) -> float:
        hooks = [h for h in self._join_hooks if isinstance(h, DDPJoinHook)]
        for hook in hooks:  # (all first: another DDP's gives up the first DDP's step too)
            hook.post_cut_short()
        for hook in hooks:  # before the count, as the others' forward does it
            hook.drop_failed_step()
        total = self._count()
        if hooks and failed_count(hooks[0].ddp, total):  # a no_sync pass's failed step
            for hook in hooks:
                hook.drop_failed_step(met=True)
            total = self._count()
        for hook in hooks:  # left with a round open: the count was this rank's part
            if counted(hook.ddp, total):  # of a failed step's round: the count is still due
                total = self._count()
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
