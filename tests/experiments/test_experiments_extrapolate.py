"""Extrapolation: one rank is pure compute, caps are chosen, bubbles follow the rules."""

from __future__ import annotations

import pytest

from xgrad.experiments.architectures import Layer, resnet50
from xgrad.experiments.extrapolate import Workload, best_cap, iteration, pipeline_bubble
from xgrad.reference.clock import LinkModel

LINK = LinkModel(5e-6, 1e-10)


def test_one_rank_is_compute_only_and_more_ranks_cost_more() -> None:
    work = Workload(tuple(resnet50()), 32, 1e13)
    alone = iteration(work, 1, LINK)
    assert alone.iteration == pytest.approx(alone.compute) and alone.exposed == 0.0
    assert alone.compute == pytest.approx(3 * work.forward_seconds())
    big = iteration(work, 1024, LINK)
    assert big.iteration > iteration(work, 8, LINK).iteration > alone.iteration


def test_best_cap_prefers_few_buckets_when_latency_dominates() -> None:
    tiny = Workload(tuple(Layer(f"l{i}", ((64,),), 1.0) for i in range(16)), 1, 1e12)
    cap, _ = best_cap(tiny, 512, LinkModel(1e-3, 0.0), [256, 1 << 20])
    assert cap == 1 << 20


def test_pipeline_bubble_without_messages_is_the_formula() -> None:
    assert pipeline_bubble("1f1b", 4, 16, 1.0, 0.0) == pytest.approx(3 / 19)
    assert pipeline_bubble("1f1b", 4, 16, 1.0, 0.5) > 3 / 19
