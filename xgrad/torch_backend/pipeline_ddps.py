"""The DDPs inside a pipeline's partitions, told when a pipeline step fails.

A stage wrapped in xgrad's DDP reduces its gradients with the same stage of the other
data-parallel replicas (``no_sync`` for all microbatches but the last). When one replica's
pipeline step fails, its DDPs never reach that step's reduction; without a word the other
replicas' reductions paired with this replica's *next* step's (silently wrong gradients,
then a gloo size mismatch that aborts the process). So the runtime tells each DDP of its
partitions that the step was given up (``DistributedDataParallel._abandon_step``), and
the DDP posts that where its peers wait.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from xgrad.pipeline import Schedule
from xgrad.torch_backend.ddp_failure import StepWatch
from xgrad.torch_backend.pipeline_args import reduce_points
from xgrad.torch_backend.pipeline_recompute import check_data_parallel

__all__ = [
    "DataParallelSteps",
    "data_parallel",
    "ddp_steps",
    "stage_ddps",
    "stage_no_sync",
    "tell_replicas",
    "unpipelined",
]


def stage_ddps(partitions: Sequence[nn.Module]) -> list[Any]:
    """The xgrad DDPs among ``partitions`` and their submodules."""
    return [
        m for p in partitions for m in p.modules() if callable(getattr(m, "_abandon_step", None))
    ]


def stage_no_sync(partitions: Sequence[nn.Module], rank: int, no_sync: Any, dp_group: Any) -> Any:
    """The ``no_sync`` factory the runtime runs with: ``no_sync`` if given; else, where a
    partition holds a ``DistributedDataParallel`` (PyTorch's or xgrad's), the ``no_sync``
    of each such DDP in the partition, as torch's ``PipelineStage`` uses a DDP stage's
    for all but the last backward on its own.

    Without it, each microbatch's forward pass was a synchronised one: DDP reduced the
    first backward pass to come and kept the later ones' gradients unreduced, which with
    a stage's forwards ahead of its backwards (GPipe, 1F1B's first stages) left every
    replica the same, silently wrong gradients.

    Raises:
        ValueError: a DDP stage with ``dp_group`` (two reductions of one gradient).
    """
    held = [[m for m in p.modules() if isinstance(m, DistributedDataParallel)] for p in partitions]
    if not any(held) or no_sync is not None:
        return no_sync
    if dp_group is not None:
        raise ValueError(
            f"rank {rank}: partition {next(i for i, h in enumerate(held) if h)} holds a "
            "DistributedDataParallel, which reduces its gradients itself: give dp_group "
            "with plain modules only"
        )

    def each_ddp(index: int) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for ddp in held[index]:
            stack.enter_context(ddp.no_sync())
        return stack

    return each_ddp


def unpipelined(hooks: Sequence[weakref.ref[Any]]) -> None:
    """A runtime driving these DDPs' gradient hooks was collected: one fewer drives each
    (a DDP used outside a pipeline afterwards posts its passes cut short as they raise,
    :mod:`.ddp_cut_short`, not at its next forward pass)."""
    for ref in hooks:
        held = ref()
        if held is not None and held.pipelined > 0:
            held.pipelined -= 1


def ddp_steps(ddps: Sequence[Any]) -> list[int]:
    """Each DDP's step number, at the start of a pipeline step."""
    return [ddp._watch.step for ddp in ddps]


def tell_replicas(
    error: BaseException, ddps: Sequence[Any], since: Sequence[int], dp: DataParallelSteps | None
) -> None:
    """After a failed step (``error``): each DDP whose step this rank gave up (it was
    accumulating for one, its synchronised pass was cut short or its backward never
    began, or it had not begun the one its peers are in: its number is still
    ``since``'s) tells its peers at once, and so do the REDUCE_GRAD all-reduces over
    ``dp_group`` (``dp``)."""
    for ddp, step in zip(ddps, since, strict=True):
        with contextlib.suppress(Exception):  # the step's own error is the one raised
            ddp._abandon_step("pipeline step", error, since=step)
    if dp is not None:
        with contextlib.suppress(Exception):
            dp.abandon(error)


class DataParallelSteps:
    """The REDUCE_GRAD all-reduces of a pipeline with ``dp_group``, step by step, on a
    failure channel and a private group of that group (a DDP's :class:`StepWatch`).

    Each pipeline step that reduces is one step of the data-parallel group, begun at the
    step's first REDUCE_GRAD. A replica whose pipeline step fails before its reductions
    are all done posts that to the data-parallel step (beginning it if it had not): the
    other replicas, waiting in its all-reduce, raise it instead of pairing it with the
    failed replica's next step (silently wrong gradients), and every rank moves to a
    fresh private group at the next step. Once this rank's reductions are all done the
    other replicas' are too, so a later failure leaves the group as it is.

    Args:
        group: the data-parallel group.
        timeout: seconds any wait may last.
        reductions: this rank's REDUCE_GRADs per step (the partitions it averages).
    """

    def __init__(self, group: Any, timeout: float, reductions: int) -> None:
        self.watch = StepWatch(group, timeout)
        self.reductions = reductions
        self.begun = False
        self.done = 0

    def start(self) -> None:
        """A pipeline step begins (its data-parallel step begins at its first reduction)."""
        self.begun, self.done = False, 0

    def group(self) -> Any:
        """The private group of this step's all-reduces (the step begun at the first)."""
        if not self.begun:
            self._begin()
        return self.watch.current_group()

    def _begin(self) -> None:
        """Begin this pipeline step's data-parallel step. Begun once the watch counted it,
        even where it then raised (a peer that does not come to its new private group):
        counted again by :meth:`abandon`, this replica's steps ran one ahead of the other
        replicas', whose all-reduces then paired with its next step's."""
        at = self.watch.step
        try:
            self.watch.begin_step()
        finally:
            self.begun = self.watch.step != at

    def wait(self, work: Any, what: str, cuda: bool = False) -> None:
        """Wait for one all-reduce (of CUDA tensors: ``cuda``), watching the data-parallel
        step's channel."""
        self.watch.wait_work(work, what, cuda)

    def finished(self) -> None:
        """One partition's REDUCE_GRAD is done (all its all-reduces awaited)."""
        self.done += 1

    def abandon(self, error: BaseException) -> None:
        """This rank's pipeline step failed (``error``): tell the other replicas, unless
        its reductions were all done (then theirs are too)."""
        if self.begun and self.done >= self.reductions:
            return
        if not self.begun:
            self._begin()
        self.watch.post_here("pipeline step", error)


def data_parallel(
    schedule: Schedule,
    rank: int,
    slot_of: dict[int, int],
    timeout: float,
    no_sync: Any,
    reduce_grad: Any,
    dp_group: Any,
) -> tuple[dict[int, int], DataParallelSteps | None, dict[int, int]]:
    """A pipeline runtime's data parallelism: where its partitions reduce (partition ->
    stage of its last REDUCE_GRAD), with ``dp_group`` the steps of its all-reduces, and
    with ``no_sync`` each stage's synchronised microbatch (the others run under it).

    Raises:
        ValueError: ``dp_group`` with ``reduce_grad`` or ``no_sync`` (two ways to reduce),
            or ``no_sync`` with a schedule a DDP stage cannot follow.
    """
    if dp_group is not None and (reduce_grad is not None or no_sync is not None):
        raise ValueError(
            f"rank {rank}: dp_group reduces at REDUCE_GRAD; give it without "
            "reduce_grad and without no_sync (DDP reduces on its own)"
        )
    synced = {} if no_sync is None else check_data_parallel(schedule, rank)
    reduce_at = reduce_points(schedule, rank, slot_of)
    dp = None if dp_group is None else DataParallelSteps(dp_group, timeout, len(reduce_at))
    return reduce_at, dp, synced
