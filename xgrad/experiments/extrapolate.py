"""Extrapolations of the cost model to real models and world sizes up to 1024.

Pure functions over :mod:`xgrad.experiments.architectures` and
:mod:`xgrad.experiments.costmodel` (no measurement here): the DDP iteration of a model
on N ranks, the best bucket cap per world size, and the pipeline bubble of schedules
with many stages when each stage-to-stage message costs ``alpha + bytes·beta``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xgrad.experiments.architectures import Layer
from xgrad.experiments.costmodel import ALGORITHMS, IterationModel, ddp_iteration
from xgrad.reference.clock import LinkModel

__all__ = ["Workload", "best_cap", "iteration", "pipeline_bubble"]


@dataclass(frozen=True)
class Workload:
    """A model's layers with the compute rate and batch that turn flops into seconds.

    Attributes:
        layers: in forward order.
        batch: samples per rank.
        flops_per_second: the compute rate of one rank.
    """

    layers: tuple[Layer, ...]
    batch: int
    flops_per_second: float

    def forward_seconds(self) -> float:
        return sum(layer.flops for layer in self.layers) * self.batch / self.flops_per_second

    def backward_seconds(self) -> list[float]:
        """Per layer, last first; a backward costs twice the forward (input and weight)."""
        return [
            2 * layer.flops * self.batch / self.flops_per_second for layer in reversed(self.layers)
        ]

    def gradient_bytes(self) -> list[int]:
        """Per layer, last first, float32."""
        return [layer.numel * 4 for layer in reversed(self.layers)]


def _comm(algorithm: str, n: int, link: LinkModel) -> Callable[[float], float]:
    fn = ALGORITHMS[algorithm]
    return lambda nbytes: fn(nbytes, n, link.alpha, link.beta)


def iteration(
    work: Workload, n: int, link: LinkModel, *, algorithm: str = "ring", cap: int = 25 << 20
) -> IterationModel:
    """One DDP iteration of ``work`` on ``n`` ranks (buckets of ``cap`` bytes)."""
    return ddp_iteration(
        work.forward_seconds(),
        work.backward_seconds(),
        work.gradient_bytes(),
        cap,
        _comm(algorithm, n, link),
    )


def best_cap(
    work: Workload, n: int, link: LinkModel, caps: Sequence[int], *, algorithm: str = "ring"
) -> tuple[int, float]:
    """The cap among ``caps`` with the shortest iteration, and that iteration's seconds."""
    times = [iteration(work, n, link, algorithm=algorithm, cap=c).iteration for c in caps]
    best = min(range(len(caps)), key=times.__getitem__)
    return caps[best], times[best]


def pipeline_bubble(
    name: str, p: int, m: int, stage_seconds: float, message_seconds: float
) -> float:
    """Bubble fraction of schedule ``name`` with p stages of equal cost (a forward of
    ``stage_seconds``, the backward twice that, split evenly for zero-bubble schedules) and
    ``message_seconds`` per stage-to-stage message."""
    import xgrad.pipeline as xp
    from xgrad.pipeline import Kind

    costs = {
        Kind.FORWARD: stage_seconds,
        Kind.BACKWARD: 2 * stage_seconds,
        Kind.BACKWARD_INPUT: stage_seconds,
        Kind.BACKWARD_WEIGHT: stage_seconds,
    }
    sim = xp.simulate(xp.make(name, p, m), costs, comm_cost=message_seconds)
    return sim.bubble_fraction
