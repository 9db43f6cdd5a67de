"""The pipeline runtime's arguments checked and turned into what its event loop reads.

Kept apart from :mod:`~xgrad.torch_backend.pipeline` so that the runtime module holds the
event loop and its failure handling only; everything here runs once, at construction, and
raises a ``ValueError`` naming the argument, the value and the rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from xgrad.failure import as_seconds
from xgrad.pipeline import (
    Invocation,
    Kind,
    Schedule,
    add_stage_ops,
    insert_comms,
    partitions_of,
    placement_of,
    sources_of,
    validate,
)
from xgrad.torch_backend.pipeline_recompute import CHECKPOINT_MODES
from xgrad.torch_backend.pipeline_rows import Rows, check_rows
from xgrad.torch_backend.pipeline_specs import ChunkSpecs, split_inputs, split_keywords_by_spec
from xgrad.torch_backend.pipeline_wire import split_batch

__all__ = [
    "KEYWORDS_ONLY",
    "check_modules",
    "check_settings",
    "reduce_points",
    "runtime_schedule",
    "slot_map",
    "split_keywords",
    "split_step",
]


class _KeywordsOnly:
    def __repr__(self) -> str:
        return "KEYWORDS_ONLY"


#: Stage 0's microbatch when the step gave the model keywords alone (torch's
#: ``schedule.step(x=x)``): the stage is called with its keywords and no positional input.
KEYWORDS_ONLY: Any = _KeywordsOnly()


def check_settings(checkpoint: str, timeout: Any) -> float:
    """Refuse an unknown checkpoint mode or a timeout that is not positive finite seconds
    (a ``timedelta`` counts as its seconds)."""
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
    seconds = as_seconds(timeout)
    if not isinstance(seconds, int | float) or not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"timeout must be positive finite seconds, got {timeout!r}")
    return float(seconds)


def runtime_schedule(
    schedule: Schedule, rank: int, world: int, *, reduces: bool = False
) -> Schedule:
    """The schedule the runtime executes: validated, with its comms inserted if it has none.

    With ``reduces`` (the runtime reduces gradients across data-parallel replicas at
    REDUCE_GRAD), a schedule without stage-level actions gets torch's
    (:func:`~xgrad.pipeline.add_stage_ops`): without a REDUCE_GRAD the replicas' gradients
    were left local without a word. One whose REDUCE_GRAD misses a stage is refused.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"schedule must be an xgrad.pipeline.Schedule (e.g. xgrad.pipeline.make(name, p, "
            f"m)), got {type(schedule).__name__} {schedule!r}"
        )
    if schedule.num_ranks != world:
        raise ValueError(f"rank {rank}: schedule has {schedule.num_ranks} ranks, the group {world}")
    idle = [r for r in range(world) if not schedule.stages_of(r)]
    if idle:
        # Every rank of the group takes part in each step's wire (its edges, the end-of-step
        # exchange); one with no stage has none, and crashed there. Refused on every rank
        # alike, so that none goes on to wait for it.
        raise ValueError(
            f"rank {rank}: the schedule places no stage on rank {idle[0]} (placement "
            f"{list(schedule.placement)}); every rank of the group must hold a stage: run "
            "the pipeline on a group of the ranks that hold stages"
        )
    if reduces:
        reduced = {a.stage for acts in schedule.actions for a in acts if a.kind is Kind.REDUCE_GRAD}
        if not any(a.kind.is_stage_op for acts in schedule.actions for a in acts):
            schedule = add_stage_ops(schedule)
        elif len(reduced) < schedule.num_stages:
            missing = min(set(range(schedule.num_stages)) - reduced)
            raise ValueError(
                f"rank {rank}: the schedule reduces gradients across data-parallel replicas "
                f"at REDUCE_GRAD, and has none for stage {missing} (its gradients would stay "
                "local); add one after its last backward, or give the schedule without "
                "stage-level actions and the runtime adds torch's (add_stage_ops)"
            )
    if schedule.has_comms:
        # Sends never block here (isend), receives only when their data is used: the
        # buffered model, as torch's own lowering assumes.
        return validate(schedule, rendezvous=False)
    # A chain's comms pair up even if sends blocked; a DAG's need the buffered model.
    return validate(insert_comms(schedule), rendezvous=schedule.is_chain)


def slot_map(
    schedule: Schedule,
    partitions: Sequence[Any],
    invocations: Sequence[Invocation] | None,
    rank: int,
) -> dict[int, int]:
    """Stage -> index of the partition that runs it on this rank (checked against both).

    Without ``invocations``, slot k is the k-th virtual stage placed on this rank.
    """
    if invocations is not None:
        if placement_of(invocations) != schedule.placement:
            raise ValueError(
                f"rank {rank}: invocations place stages on {placement_of(invocations)}, "
                f"the schedule on {schedule.placement}"
            )
        wanted = sources_of(invocations)
        scheduled = tuple(schedule.sources(s) for s in range(schedule.num_stages))
        if wanted != scheduled:
            # Without this a chain schedule ran a DAG's partitions as a chain: skip
            # connections dropped, gradients silently wrong.
            raise ValueError(
                f"rank {rank}: invocations feed the stages from {list(wanted)}, the schedule "
                f"from {list(scheduled)} (a DAG needs a schedule with those inputs, e.g. "
                "from_invocations)"
            )
        slot_of = {s: loc.index for s, loc in enumerate(partitions_of(invocations))}
    else:
        slot_of = {s: k for k, s in enumerate(schedule.stages_of(rank))}
    mine = {slot_of[s] for s in schedule.stages_of(rank)}
    if mine and max(mine) >= len(partitions):
        raise ValueError(
            f"rank {rank}: needs partitions for slots {sorted(mine)}, "
            f"got {len(partitions)} partitions"
        )
    idle = sorted(set(range(len(partitions))) - mine)
    if idle:
        # Left running nothing, a partition's layers would silently drop out of the model
        # (a whole nn.Sequential passed as the list is iterated as its layers).
        raise ValueError(
            f"rank {rank}: the schedule runs partitions {sorted(mine)} on this rank, got "
            f"{len(partitions)} partitions ({idle} would run nowhere); pass one module per "
            "slot (a single nn.Sequential stage as [stage])"
        )
    return slot_of


def check_modules(partitions: Sequence[Any], rank: int) -> None:
    """Refuse a partition that is not a module (found at construction, not as an
    ``AttributeError`` in the first step with no rank named)."""
    for k, part in enumerate(partitions):
        if not isinstance(part, nn.Module):
            raise TypeError(
                f"rank {rank}: partition {k} is a {type(part).__name__}, not a torch.nn.Module"
            )


def reduce_points(schedule: Schedule, rank: int, slot_of: dict[int, int]) -> dict[int, int]:
    """Partition index -> the stage of its last REDUCE_GRAD on this rank.

    A partition invoked at several stages is reduced once, at its last REDUCE_GRAD.
    """
    at: dict[int, int] = {}
    for a in schedule.actions[rank]:
        if a.kind is Kind.REDUCE_GRAD:
            at[slot_of[a.stage]] = a.stage
    return at


def split_step(
    schedule: Schedule,
    rank: int,
    inputs: Any,
    targets: Any,
    mine: set[int],
    *,
    evaluating: bool = False,
    keywords: dict[str, Any] | None = None,
    specs: ChunkSpecs | None = None,
) -> tuple[Any, Any, list[dict[str, Any]] | None]:
    """``rank``'s microbatches of a step's inputs (stage 0), targets (the last stage;
    optional in an evaluation, which then computes no loss) and the model's keywords (each
    of this rank's stages; ``None`` without any).

    Stage 0 given no inputs but tensor keywords is called with the keywords alone
    (:data:`KEYWORDS_ONLY`), as torch's ``schedule.step(x=x)`` calls it. ``specs``: the
    runtime's ``args_chunk_spec`` and ``kwargs_chunk_spec`` (:mod:`.pipeline_specs`; unused
    where there are no inputs, or no keywords, as torch's). Tensors split as torch's
    ``tensor_split``, unevenly where m does not divide them; those of this rank must then
    split alike (:func:`~xgrad.torch_backend.pipeline_rows.check_rows`). Also refuses a
    training step under ``torch.no_grad()``: its forwards would keep no graph, and the
    first backward would fail after others had added to ``.grad``.
    """
    if not evaluating and not torch.is_grad_enabled():
        raise RuntimeError(
            f"rank {rank}: step() runs the backward pass too, and was called with "
            "gradients disabled (torch.no_grad() or inference_mode); call it outside, or "
            "eval() for the forwards alone"
        )
    m, last = schedule.num_microbatches, schedule.num_stages - 1
    specs = specs or ChunkSpecs()
    # Each tensor's size along its split dim, to check they split alike (pipeline_rows).
    rows: Rows = []
    xs = None
    if 0 in mine and inputs is None and keywords:
        if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(keywords)):
            raise TypeError(
                f"rank {rank}: inputs must be a tensor or a pytree of tensors on this rank "
                f"(the rank of stage 0), got None, and the keywords {sorted(keywords)} hold "
                "no tensor to split into microbatches either"
            )
        xs = [KEYWORDS_ONLY] * m
    elif 0 in mine and specs.args is not None and inputs is not None:
        xs = split_inputs(inputs, specs.args, m, rank, rows)
    elif 0 in mine:
        xs = split_batch(inputs, m, "inputs", rank, rows)
    kws = None
    if keywords and specs.kwargs is not None:
        kws = split_keywords_by_spec(keywords, specs.kwargs, m, rank, rows)
    elif keywords:
        kws = split_keywords(keywords, m, rank, rows)
    wanted = last in mine and not (evaluating and targets is None)
    ys = split_batch(targets, m, "targets", rank, rows) if wanted else None
    check_rows(rows, m, rank)
    return xs, ys, kws


def split_keywords(
    keywords: dict[str, Any], m: int, rank: int, rows: Rows | None = None
) -> list[dict[str, Any]]:
    """A step's keywords for the model as m microbatches' (torch's
    ``split_args_kwargs_into_chunks`` without a ``kwargs_chunk_spec``): a tensor split
    along dim 0 like the inputs (each tensor of a container too, as torch's; unevenly where
    m does not divide it), any other value given whole to every microbatch.

    Raises:
        ValueError: a tensor with fewer rows than m, or a 0-dim one (naming the keyword and
            the rank), before anything is sent.
    """
    columns: dict[str, list[Any]] = {}
    for name, value in keywords.items():
        if any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value)):
            columns[name] = split_batch(value, m, f"keyword {name!r}", rank, rows)
        else:
            columns[name] = [value] * m
    return [{name: column[k] for name, column in columns.items()} for k in range(m)]
