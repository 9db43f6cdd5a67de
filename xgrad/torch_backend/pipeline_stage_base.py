"""What a pipeline stage's passes share beyond the settings and lookups of
:class:`~xgrad.torch_backend.pipeline_stage_settings.StageSettings`: the forward call with
its loss (checked: :mod:`~xgrad.torch_backend.pipeline_loss_check`; the tensors the stage
and its loss read of their own found), REDUCE_GRAD over a data-parallel group, and the
step's division of the gradients by m.
The passes themselves are :class:`~xgrad.torch_backend.pipeline_stage.StagePasses`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from xgrad.pipeline import Action, Kind
from xgrad.torch_backend.pipeline_args import KEYWORDS_ONLY
from xgrad.torch_backend.pipeline_average import average_grads
from xgrad.torch_backend.pipeline_loss_check import checked_loss
from xgrad.torch_backend.pipeline_loss_params import StageLeaves, Stops, module_params
from xgrad.torch_backend.pipeline_scale import StepScaling, scale_points
from xgrad.torch_backend.pipeline_shared_graph import Made, forward_mark
from xgrad.torch_backend.pipeline_stage_settings import StageSettings
from xgrad.torch_backend.pipeline_step_data import StepData
from xgrad.torch_backend.pipeline_wire import tensor_leaves

__all__ = ["StageState"]


class StageState(StageSettings):
    """The passes' helpers that call the loss or touch the gradients (the settings, the
    step's state and the lookups on them: :class:`StageSettings`)."""

    # -- helpers -------------------------------------------------------------------------

    def _start_grads(self) -> None:
        """A step begins: its REDUCE_GRAD all-reduces' data-parallel step, and, for a
        training step with ``scale_grads`` and m > 1, the division of the gradients by m
        after each partition's last backward or reduction, as torch's (pipeline_scale)."""
        if self._scaling is not None:
            self._scaling.abandon()  # (done already, unless a step ended unseen)
            self._scaling = None
        self._leaves, self._whole_walk = {}, False
        self._data, self._reads_data = None, frozenset()
        m = self.schedule.num_microbatches
        if self._evaluating:
            return
        if self._dp is not None:
            self._dp.start()
        if self.scale_grads and m > 1 and not self._loss_scaled():
            if self._points is None or self._points[0] is not self._actions:
                reduces = self._reduce_grad is not None or self._dp_group is not None
                at = scale_points(self._actions, self._slot_of, self._reduce_at, reduces)
                self._points = (self._actions, at)
            self._scaling = StepScaling(
                m, self._actions, self._points[1], self.partitions, self._loss_params()
            )
        # Whether each forward walks its stage's graph for the tensors it reads of its own
        # (pipeline_loss_params): where they are divided after the backward, differentiated
        # by W, or averaged; elsewhere each backward reaches them with its loss divided.
        self._whole_walk = (
            self._scaling is not None
            or self._dp_group is not None
            or any(a.kind is Kind.BACKWARD_WEIGHT for a in self._actions)
        )

    def _loss_scaled(self) -> bool:
        """Whether each microbatch's loss is divided by m before its backward, instead of
        the gradients after (pipeline_scale): where m is a power of two. Dividing by a
        power of two is exact, so the gradients are torch's bit for bit either way, and
        the division of a scalar costs nothing where dividing every gradient after the
        step's last backward puts a pass over them on its critical path (about 2% of a
        1F1B step at p = 4 in ``xgrad bench pipeline``)."""
        m = self.schedule.num_microbatches
        return self.scale_grads and m > 1 and m & (m - 1) == 0

    def _loss_params(self) -> tuple[int, list[torch.Tensor]] | None:
        """On the last stage's rank, the loss's parameters known so far, with the point of
        that stage's partition: divided there as the unpipelined model's (pipeline_scale;
        those the step's forwards find join them there, ``_see``)."""
        slot = self._slot_of.get(self.schedule.num_stages - 1)
        if slot is None or self._points is None:
            return None
        at = self._points[1].get(slot)
        return None if at is None else (at, self._loss_weights())

    def _loss_weights(self) -> list[torch.Tensor]:
        """The loss's parameters that require grad: a module ``loss_fn``'s, and the tensors
        a loss function (or the last stage's forward) reads of its own, found in its graph
        (pipeline_loss_params). The last stage's W (and the joins its I pass finds)
        differentiates them with the stage's own, as B does, else a zero-bubble step left
        their ``.grad`` None."""
        return self._leaves_of(self.schedule.num_stages - 1).weights(self.loss_fn)

    def _leaves_of(self, stage: int) -> StageLeaves:
        found = self._leaves.get(stage)
        if found is None:
            found = self._leaves[stage] = StageLeaves()
        return found

    def _know_data(self, given: Any, hooked: Any) -> None:
        """The step's data on this rank (pipeline_step_data), where the forwards' walks
        tell it from the stages' own tensors: ``given``, what the step was given, and
        ``hooked``, its microbatches' tensors that the division by m hooks."""
        if self._whole_walk and not self._evaluating:
            self._data = StepData.of(given, hooked)

    def _see(self, stage: int, roots: list[torch.Tensor], stops: Stops, made: Made) -> None:
        """What ``roots`` (the loss, or a stage's outputs) reach of the stage's own that the
        step had not found: divided with the stage's parameters from now (pipeline_scale);
        and where they read the step's data (pipeline_step_data), divided as they read it
        where the gradients are divided after the backward; and whether they reach nodes
        made before the forward (numbered outside ``made``: pipeline_shared_graph)."""
        leaves = self._leaves_of(stage)
        params = self._module(stage).parameters
        found, entries = leaves.see(roots, stops, params, self._data, made)
        if entries:
            self._reads_data = self._reads_data | {stage}
            if self._scaling is not None:
                self._scaling.divide_entries(entries)
        if found and self._scaling is not None and self._points is not None:
            at = self._points[1].get(self._slot_of[stage])
            if at is not None:
                self._scaling.more(found, at)

    def _params(self, stage: int) -> Callable[[], list[torch.Tensor]]:
        """What W differentiates: the stage's parameters and what it reads of its own (the
        last stage's loss's too)."""
        loss_fn = self.loss_fn if stage == self.schedule.num_stages - 1 else None
        return lambda: list(
            {
                id(p): p
                for p in (
                    *self._module(stage).parameters(),
                    *self._leaves_of(stage).weights(loss_fn),
                )
                if p.requires_grad
            }.values()
        )

    def _run_forward(self, stage: int, mb: int, x: Any, target: Any) -> Any:
        args = () if x is KEYWORDS_ONLY else (x,)
        last = stage == self.schedule.num_stages - 1
        # Where a walk of the stage's graph for what it reads of its own ends (its
        # arguments; the loss's too on the last stage): taken before the call.
        graph = not self._evaluating and torch.is_grad_enabled()
        walks = graph and self._whole_walk
        # Elsewhere the stage's graph is walked once a step, for nodes made before the
        # forward that the microbatches share (pipeline_shared_graph).
        probes = graph and not walks and not self._leaves_of(stage).probed
        stops = None
        if walks or probes:
            given = (x, target, self._loss_kwargs) if last else (x,)
            stops = StageLeaves.stops(*given, self._keywords_of(mb))
        mark = forward_mark()
        with self._sync_context(stage, mb):
            y = self._module(stage)(*args, **self._keywords_of(mb))
        made = (mark, forward_mark())  # the numbers the forward's nodes took
        if stops is not None and probes:
            self._leaves_of(stage).probe(tensor_leaves(y), stops, made)
            stops = None
        if stops is not None and not last:
            self._see(stage, tensor_leaves(y), stops, made)
        if last and self._keep_outputs and mb not in self._outputs:  # (a recompute's: equal)
            # Detached, all of them. torch's backward detaches its outputs in place, to
            # free their graph, but cannot detach a view in place, and returns views
            # (``y[:, :2]``, ``y.view(...)``) with theirs: it holds the stage's inputs and
            # their gradients, and a backward through it fails (freed). Its ``eval`` runs
            # with gradients and returns every output with its graph and saved activations.
            self._outputs[mb] = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, y)
        if last and self._evaluating:
            if target is not None:
                self._losses[mb] = self._loss(y, target).detach()
            return y
        if last:
            if stops is None and torch.is_grad_enabled():  # the loss's own graph alone
                stops = StageLeaves.stops(x, y, target, self._loss_kwargs, self._keywords_of(mb))
            loss = self._loss(y, target)
            if stops is not None:
                self._see(stage, [loss], stops, (mark, forward_mark()))
            self._losses[mb] = loss.detach()  # for step(losses=), as torch reports them
            if self._loss_scaled():  # m a power of two: exact, and free (_loss_scaled)
                return loss / self.schedule.num_microbatches
            return loss  # its backward as it is: the gradients are divided after (_scaling)
        return y

    def _loss(self, y: Any, target: Any) -> torch.Tensor:
        """``loss_fn(y, target)``, checked (pipeline_loss_check): the output's batch is
        along the ``output_merge_spec``'s dim (dim 0 unless it says otherwise)."""
        return checked_loss(self.loss_fn, y, target, self._loss_kwargs, self._chunk_specs.batch_dim)

    def _average_grads(self, action: Action) -> None:
        """REDUCE_GRAD with a data-parallel group: the partition's gradients averaged over
        it (pipeline_average), with the tensors its stages read of their own (the last
        stage's loss's too)."""
        module = self._module(action.stage)
        params: list[torch.Tensor] = list(module.parameters())
        listed = {id(p) for p in params}
        last = self.schedule.num_stages - 1
        slot = self._slot_of[action.stage]
        stages = [s for s, at in self._slot_of.items() if at == slot]  # (invocations)
        if last in stages:
            for p in module_params(self.loss_fn):  # every replica's lists the same
                if id(p) not in listed:
                    listed.add(id(p))
                    params.append(p)
        found: dict[int, torch.Tensor] = {}
        for s in stages:
            for key, t in self._leaves_of(s).found.items():
                if key not in listed:
                    found.setdefault(key, t)
        size = dist.get_world_size(self._dp_group)
        device = self._device(action.stage)
        holder = (self.loss_fn, module) if last in stages else module  # (their order)
        reader = "the loss or forward" if last in stages else "the forward"
        reader = f"{reader} of stage {'/'.join(map(str, stages))}"
        average_grads(
            self._dp, size, str(action), params, list(found.values()), device, holder, reader
        )
        self._dp.finished()
