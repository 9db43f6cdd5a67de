"""A static graph's repeated hooks: learned in the first iteration, counted after it.

Driven on simulated ranks through the reducer (the model-level check against PyTorch's
DDP, reentrant checkpointing with a block run twice, is in
tests/torch_backend/test_torch_ddp_arrivals.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from xgrad.buckets import BucketPlan
from xgrad.numpy_ops import NumpyOps
from xgrad.reducer import Reducer
from xgrad.reducer_static import HookCounts
from xgrad.reference import RankError, ReferenceComm, spawn

SHAPES = [(3,), (4,), (2,)]
PLAN = BucketPlan(((2,), (1, 0)), (64, 64))


def grads(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(10 * rank + step)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def test_counts_hold_until_the_last_hook() -> None:
    counts = HookCounts(3)
    counts.start()
    assert counts.active(learning=True)
    for i, g in ((2, "a"), (1, "b"), (1, "c"), (0, "d")):
        assert counts.hold(i, g, float(len(g)), learning=True)
    assert [(i, g) for i, g, _ in counts.release()] == [(2, "a"), (1, "c"), (0, "d")]
    assert counts.learned == [1, 2, 1] and counts.repeats
    counts.start()
    assert not counts.hold(2, "x", 0.0, learning=False)
    assert counts.hold(1, "y", 0.0, learning=False)  # the first of two
    assert not counts.hold(1, "y", 0.0, learning=False)  # the last: marked now
    assert not counts.hold(1, "y", 0.0, learning=False)  # one too many: let through


def test_no_repeats_hold_nothing_after_the_first_iteration() -> None:
    counts = HookCounts(2)
    counts.start()
    counts.hold(0, "a", 0.0, learning=True)
    assert list(counts.release()) == [(0, "a", 0.0)]
    assert not counts.repeats and not counts.active(learning=False)
    assert not counts.hold(0, "b", 0.0, learning=False)


def _reduce(comm: ReferenceComm, fires: int, steps: int) -> list[dict[int, np.ndarray]]:
    """Parameter 1's hook runs twice per iteration (a partial gradient, then the whole)."""
    got: dict[int, np.ndarray] = {}
    reducer = Reducer(
        [np.zeros(s, np.float32) for s in SHAPES],
        PLAN,
        comm,
        NumpyOps(),
        set_grad=lambda i, v: got.__setitem__(i, np.array(v)),
        static_graph=True,
        rebuild=False,
    )
    out = []
    for step in range(steps):
        reducer.prepare_for_backward()
        g = grads(comm.rank, step)
        reducer.mark_ready(2, g[2])
        for k in range(2 if step == 0 else fires):
            reducer.mark_ready(1, g[1] * 0.5 if k == 0 else g[1])
        reducer.mark_ready(0, g[0])
        reducer.finalize()
        out.append(dict(got))
    return out


def test_a_parameter_reduced_at_its_last_hook() -> None:
    for steps in spawn(lambda comm: _reduce(comm, 2, 3), 2):
        for step, got in enumerate(steps):
            for i in range(3):
                want = grads(0, step)[i] * np.float32(0.5) + grads(1, step)[i] * np.float32(0.5)
                np.testing.assert_array_equal(got[i], want)


def test_a_hook_beyond_the_learned_count_is_marked_twice() -> None:
    with pytest.raises(RankError) as err:
        spawn(lambda comm: _reduce(comm, 3, 2), 2)
    assert "Parameter at index 1 with name param[1] has been marked as ready twice" in str(
        err.value.__cause__
    )


def _changing(comm: ReferenceComm, used: list[set[int]]) -> None:
    """A static graph whose parameters used differ between iterations (``used[step]``)."""
    reducer = Reducer(
        [np.zeros(s, np.float32) for s in SHAPES],
        PLAN,
        comm,
        NumpyOps(),
        set_grad=lambda i, v: None,
        static_graph=True,
        rebuild=False,
    )
    for step, params in enumerate(used):
        reducer.prepare_for_backward()
        g = grads(comm.rank, step)
        for i in sorted(params, reverse=True):
            reducer.mark_ready(i, g[i])
        reducer.finalize()


@pytest.mark.parametrize(
    ("used", "words", "names"),
    [
        ([{0, 1}, {0, 1, 2}], "is unused in first iteration, but then got used", "param[2]"),
        ([{0, 1, 2}, {0, 1}], "is used in first iteration, but then got unused", "param[2]"),
    ],
)
def test_a_static_graph_that_changed_says_so_in_pytorchs_words(
    used: list[set[int]], words: str, names: str
) -> None:
    """It said a parameter was marked ready twice (1, 2, 3: none of them the cause), or
    that some parameters received no gradient, without naming the static graph."""
    with pytest.raises(RankError) as err:
        spawn(lambda comm: _changing(comm, used), 2)
    text = str(err.value.__cause__)
    assert text.startswith("Your training graph has changed in this iteration, e.g., one"), text
    assert words in text and "not compatible with static_graph set to True" in text, text
    assert names in text, text
