"""The pipeline runtime's ``step`` and the arguments of ``step`` and ``eval``, taken as
torch's schedules take them.

``torch.distributed.pipelining``'s ``schedule.step(*args, target=None, losses=None,
return_outputs=True, loss_kwargs=None, **kwargs)`` and ``schedule.eval`` name the targets
``target``, give ``loss_fn(output, target, **loss_kwargs)`` its keywords and return the
last stage's outputs, merged along the batch dimension (checked on torch 2.13). The
runtime's ``step`` returns the loss: ``return_outputs=None``, its default, keeps that,
``True`` returns what torch's returns and ``False`` nothing. The model's own keywords
(torch's ``**kwargs``) are split into microbatches as torch splits them (by default, or as
the runtime's chunk specs say: :mod:`~xgrad.torch_backend.pipeline_specs`) and given to
each stage this rank runs. Kept apart from :mod:`~xgrad.torch_backend.pipeline_loop`, which
holds the event loop (``_run_step``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xgrad.pipeline import Schedule
from xgrad.torch_backend.pipeline_args import split_step
from xgrad.torch_backend.pipeline_merge import merge_outputs
from xgrad.torch_backend.pipeline_specs import ChunkSpecs

__all__ = ["StepCall", "merge_outputs", "step_arguments"]


def step_arguments(method: str, targets: Any, target: Any, losses: Any) -> Any:
    """The targets of a call of ``method`` (``"step"``, ``"eval"``), given as ``targets``
    or as torch's ``target``, with ``losses`` checked.

    ``None`` is no targets, as torch's default; both given is a ``TypeError`` naming both,
    as Python's own for an argument given twice (one of them would be dropped unseen).

    Raises:
        TypeError: both ``targets`` and ``target`` given, or ``losses`` not a list.
    """
    if losses is not None and not isinstance(losses, list):
        raise TypeError(f"losses must be a list, got a {type(losses).__name__}")
    if target is None:
        return targets
    if targets is not None:
        raise TypeError(
            f"PipelineRuntime.{method}() got multiple values for argument 'targets': "
            "targets and target= (torch's name for it); give one"
        )
    return target


class StepCall:
    """:meth:`step`, the part of :class:`~xgrad.torch_backend.pipeline.PipelineRuntime`
    that takes torch's keywords and returns what was asked for (its ``_run_step`` runs the
    actions; the last stage's forward keeps its outputs while ``_keep_outputs``)."""

    _outputs: dict[int, Any]  # per microbatch, the last stage's output (detached)
    _keep_outputs: bool
    _loss_kwargs: dict[str, Any] | None
    _keywords: dict[str, Any] | None
    _keyword_mbs: list[dict[str, Any]] | None
    _target_mbs: list[Any] | None
    _data: Any  # the step's data on this rank (pipeline_step_data), through the step
    _chunk_specs: ChunkSpecs  # the runtime's args/kwargs_chunk_spec, output_merge_spec
    rank: int
    schedule: Schedule
    _evaluating: bool
    _run_step: Callable[..., Any]

    def step(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool | None = None,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one step: every action of this rank, in order.

        Torch's ``schedule.step(*args, target=..., **kwargs)`` calls stage 0 as
        ``forward(*args)``; here ``inputs`` is stage 0's one positional argument (a pytree
        for several) and a second positional argument is ``targets`` (xgrad's form, kept).

        Args:
            inputs: the whole batch (a tensor or a pytree of them, split along dim 0 as
                torch's ``tensor_split``: 10 rows into 4 microbatches are 3, 3, 2, 2), on
                the rank of stage 0. ``None`` there with tensor ``kwargs``: stage 0 is
                called with the keywords alone (``step(x=x)``). Given on another rank, it is
                not split there, but what a stage or the loss there reads of it is the
                replica's data (see the runtime's ``dp_group``), as targets given on a rank
                without the last stage.
            targets: the whole batch's targets, on the rank of the last stage.
            target: torch's name for ``targets`` (its ``schedule.step(x, target=y)``); give
                one of the two (both: a ``TypeError`` naming them).
            losses: on the last stage's rank, a list emptied and filled with each
                microbatch's loss (detached, before the 1/m scaling), as torch's
                ``schedule.step(..., losses=)`` fills it; left as it is on the others.
            return_outputs: ``None`` (default) returns the loss, as xgrad always did;
                ``True`` returns what torch's ``step`` returns by default (the last stage's
                outputs, merged) and ``False`` nothing, as torch's
                ``step(return_outputs=False)``. The outputs are kept through the step only
                when ``True``, detached, as torch detaches them to free their graph. Every
                one: torch cannot detach a view in place and returns it (``y[:, :2]``, and
                the merged batch made of such views) requiring grad, with a graph that
                holds the stage's inputs and their gradients and that a backward cannot
                go through (the step's backward freed it). Equal values, no graph here.
            loss_kwargs: keywords for the loss, called ``loss_fn(output, target,
                **loss_kwargs)`` on every microbatch, as torch's schedules call it.
            **kwargs: keywords for the model, split as torch splits them: a tensor (each
                tensor of a container too, as torch's) chunked along dim 0 into the
                microbatches, any other value given whole to each, or as the runtime's
                ``kwargs_chunk_spec`` says (and the inputs as its ``args_chunk_spec``). As
                in torch, each rank's go to every stage it runs (one stage a rank:
                ``step(x, mask=m)`` on stage 0's reaches stage 0 alone), each microbatch's
                forward called ``forward(x, **its_kwargs)``. A tensor keyword that requires
                grad gets the unpipelined model's gradient in ``.grad``, each microbatch's
                divided by m as it reaches it, as stage 0's batch (torch's is m times that:
                it divides the parameters' gradients alone by m, after the backward).

        Returns:
            On the last stage's rank: the whole batch's loss (detached) by default; with
            ``return_outputs=True`` its outputs for the whole batch, merged as torch's
            ``merge_chunks`` merges them (tensor leaves concatenated along dim 0, the
            pytree kept, or as the runtime's ``output_merge_spec`` says); ``None`` with
            ``False``. ``None`` on the other ranks.

        Raises:
            xgrad.failure.RankError: this or another rank failed (the message names where),
                or a peer stopped answering, or a wait ran past ``timeout``.
            TypeError: both ``targets`` and ``target``, ``losses`` not a list,
                ``return_outputs`` not ``None`` or a bool, ``loss_kwargs`` not a dict
                (raised before any message, on the rank given it).
            ValueError: a tensor keyword (or input, target) with fewer rows than
                microbatches, or that would split otherwise than another of this rank's
                (:mod:`~xgrad.torch_backend.pipeline_rows`), or with no dim 0 (or no spec'd
                dim; a keyword without
                a spec in ``kwargs_chunk_spec``, or a spec for one not given): raised on the
                rank given it, naming it, before this rank sends anything; the other ranks
                raise a RankError. Outputs that ``output_merge_spec`` cannot merge: on the
                last stage's rank alone, after the step.
        """
        targets = step_arguments("step", targets, target, losses)
        if return_outputs is not None and not isinstance(return_outputs, bool):
            raise TypeError(f"return_outputs={return_outputs!r} must be None or a bool")
        keep = return_outputs is True
        loss, outputs = self._called(inputs, targets, losses, keep, loss_kwargs, kwargs)
        return loss if return_outputs is None else outputs

    def _called(
        self,
        inputs: Any,
        targets: Any,
        losses: list[Any] | None,
        keep: bool,
        loss_kwargs: dict[str, Any] | None,
        keywords: dict[str, Any],
    ) -> tuple[Any, Any]:
        """Run a step (or, under ``evaluating``, an evaluation) with the model's
        ``keywords``: its loss, and the last stage's merged outputs there when ``keep``
        (else ``None``)."""
        if loss_kwargs is not None and not isinstance(loss_kwargs, dict):
            raise TypeError(f"loss_kwargs must be a dict, got a {type(loss_kwargs).__name__}")
        self._keep_outputs, self._loss_kwargs, self._keywords = keep, loss_kwargs, keywords
        try:
            loss = self._run_step(inputs, targets, losses)
            outputs = self._outputs
        finally:  # a failed step's outputs are not kept either, nor the keywords' chunks
            self._keep_outputs, self._loss_kwargs, self._outputs = False, None, {}
            self._keywords = self._keyword_mbs = self._target_mbs = None
            self._data = None  # the graph the batch was computed through goes with it
        # Merged after the step, which every rank finished: an output that cannot be merged
        # fails here alone, leaving the step's group as it is (inside the step, its
        # failure reset this rank's group and not the others', and the next step timed out).
        if not outputs:
            return loss, None
        chunks = [outputs[mb] for mb in sorted(outputs)]
        return loss, merge_outputs(chunks, self._chunk_specs.outputs, self.rank)

    def _split(self, inputs: Any, targets: Any, mine: set[int]) -> tuple[Any, Any, Any]:
        """This rank's microbatches of the inputs (stage 0), targets (the last stage) and
        the model's keywords (its every stage)."""
        return split_step(
            self.schedule,
            self.rank,
            inputs,
            targets,
            mine,
            evaluating=self._evaluating,
            keywords=self._keywords,
            specs=self._chunk_specs,
        )
