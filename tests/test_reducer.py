"""The reducer state machine on simulated ranks: order, unused parameters, errors, rebuild.

The model-level scenarios (PyTorch's ignored-output pair, world sizes 1..8 against the
single-process gradients) live in tests/reference; these drive ``mark_ready`` directly
so each rule of the state machine is checked on its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from xgrad.buckets import BucketPlan, assign_buckets
from xgrad.hooks import HOOKS
from xgrad.numpy_ops import NumpyOps
from xgrad.reducer import Reducer
from xgrad.reference import RankError, ReferenceComm, spawn

SHAPES = [(3,), (2, 2), (5,), (1,)]
NAMES = ["a.weight", "a.bias", "b.weight", "b.bias"]


def grads_for(rank: int, dtype: Any = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return [rng.standard_normal(s).astype(dtype) for s in SHAPES]


def expected_mean(world: int, dtype: Any = np.float32) -> list[np.ndarray]:
    """DDP's arithmetic: each rank multiplies by 1/N, then the sum in rank order."""
    scale = np.dtype(dtype).type(1.0 / world)
    out = []
    for i in range(len(SHAPES)):
        total = grads_for(0, dtype)[i] * scale
        for r in range(1, world):
            total = total + grads_for(r, dtype)[i] * scale
        out.append(total)
    return out


def make_reducer(
    comm: ReferenceComm,
    plan: BucketPlan,
    got: dict[int, np.ndarray],
    params: Sequence[np.ndarray] | None = None,
    **kwargs: Any,
) -> Reducer:
    tick = itertools.count()
    return Reducer(
        params if params is not None else [np.zeros(s, np.float32) for s in SHAPES],
        plan,
        comm,
        NumpyOps(),
        names=NAMES,
        set_grad=lambda i, v: got.__setitem__(i, np.array(v)),
        clock=lambda: float(next(tick)),
        **kwargs,
    )


TWO_BUCKETS = BucketPlan(((2, 3), (0, 1)), (64, 64))


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_averaged_gradients_bit_for_bit(world: int) -> None:
    def body(comm: ReferenceComm) -> dict[int, np.ndarray]:
        got: dict[int, np.ndarray] = {}
        reducer = make_reducer(comm, TWO_BUCKETS, got)
        reducer.prepare_for_backward()
        for i in (3, 2, 1, 0):
            reducer.mark_ready(i, grads_for(comm.rank)[i])
        reducer.finalize()
        return got

    want = expected_mean(world)
    for got in spawn(body, world):
        for i in range(len(SHAPES)):
            np.testing.assert_array_equal(got[i], want[i])


def test_buckets_launch_in_bucket_order() -> None:
    """Bucket 1 is ready first, but waits until bucket 0 is ready and launched."""

    def body(comm: ReferenceComm) -> Any:
        reducer = make_reducer(comm, TWO_BUCKETS, {})
        reducer.prepare_for_backward()
        for i in (0, 1, 2, 3):  # bucket 1 = (0, 1) completes before bucket 0 = (2, 3)
            reducer.mark_ready(i, grads_for(comm.rank)[i])
        reducer.finalize()
        return reducer.records[-1]

    for record in spawn(body, 2):
        assert record.ready_order == (0, 1, 2, 3)
        launch0, launch1 = record.launch_times
        last_ready = record.ready_times[-1]  # param 3 completes bucket 0
        assert launch0 < launch1
        assert launch1 > last_ready  # bucket 1 was held back until bucket 0 launched


def test_unused_parameters_marked_at_first_hook_and_globally_unused_left_alone() -> None:
    def body(comm: ReferenceComm) -> dict[int, np.ndarray]:
        got: dict[int, np.ndarray] = {}
        reducer = make_reducer(comm, TWO_BUCKETS, got, find_unused_parameters=True)
        # Rank 0 does not use parameter 1; no rank uses parameter 3.
        unused = [1, 3] if comm.rank == 0 else [3]
        reducer.prepare_for_backward(unused)
        g = grads_for(comm.rank)
        for i in (2, 0, 1):
            if i not in unused:
                reducer.mark_ready(i, g[i])
        reducer.finalize()
        return got

    results = spawn(body, 2)
    half = np.float32(0.5)
    for got in results:
        assert 3 not in got  # globally unused: the gradient is left untouched, as DDP does
        np.testing.assert_array_equal(got[1], grads_for(1)[1] * half)  # 0 + g/2
        np.testing.assert_array_equal(got[0], grads_for(0)[0] * half + grads_for(1)[0] * half)


@pytest.mark.parametrize("many", [False, True])
def test_a_hook_without_a_gradient_counts_as_unused_on_that_rank(many: bool) -> None:
    """PyTorch's local used map counts defined gradients only (an output the loss left out)."""

    def body(comm: ReferenceComm) -> dict[int, np.ndarray]:
        got: dict[int, np.ndarray] = {}
        reducer = make_reducer(comm, TWO_BUCKETS, got, find_unused_parameters=True)
        reducer.prepare_for_backward()  # the search found every parameter reachable
        g = grads_for(comm.rank)
        # Parameter 3's hook fires without a gradient everywhere; 1 only on rank 0.
        none = (3, 1) if comm.rank == 0 else (3,)
        order = (3, 2, 1, 0)
        grads = [None if i in none else g[i] for i in order]
        if many:
            reducer.mark_many(order, grads)
        else:
            for i, grad in zip(order, grads, strict=True):
                reducer.mark_ready(i, grad)
        reducer.finalize()
        return got

    half = np.float32(0.5)
    for got in spawn(body, 2):
        assert 3 not in got  # no rank gave a gradient: left untouched
        np.testing.assert_array_equal(got[1], grads_for(1)[1] * half)


@pytest.mark.parametrize("with_unused", [False, True])
def test_discarded_forward_leaves_nothing_behind(with_unused: bool) -> None:
    """PyTorch's test_ignored_output pair at the reducer level."""

    def body(comm: ReferenceComm) -> list[dict[int, np.ndarray]]:
        got: dict[int, np.ndarray] = {}
        reducer = make_reducer(comm, TWO_BUCKETS, got, find_unused_parameters=with_unused)
        unused = [3] if with_unused else []
        for _ in range(4):  # outputs dropped: prepared, but no hook ever fires
            assert not reducer.rebuild_buckets()
            reducer.prepare_for_backward(unused)
        steps = []
        for _ in range(4):
            reducer.rebuild_buckets()
            reducer.prepare_for_backward(unused)
            for i in (2, 1, 0, 3):
                if i not in unused:
                    reducer.mark_ready(i, grads_for(comm.rank)[i])
            reducer.finalize()
            steps.append(dict(got))
        return steps

    want = expected_mean(2)
    for steps in spawn(body, 2):
        for got in steps:
            for i in got:
                np.testing.assert_array_equal(got[i], want[i])
            assert (3 in got) is not with_unused


def test_marked_twice_names_parameter_and_rank() -> None:
    def body(comm: ReferenceComm) -> None:
        reducer = make_reducer(comm, TWO_BUCKETS, {})
        reducer.prepare_for_backward()
        reducer.mark_ready(1, grads_for(comm.rank)[1])
        reducer.mark_ready(1, grads_for(comm.rank)[1])

    with pytest.raises(RankError) as err:
        spawn(body, 2)
    text = str(err.value.__cause__)
    assert "Parameter at index 1 with name a.bias has been marked as ready twice" in text
    assert "rank 0" in text


def test_missing_gradient_raises_at_finalize_at_the_check_and_at_the_next_iteration() -> None:
    def body(comm: ReferenceComm) -> tuple[str, str]:
        reducer = make_reducer(comm, TWO_BUCKETS, {})
        reducer.prepare_for_backward()
        for i in (2, 0, 1):  # parameter 3 never gets a gradient
            reducer.mark_ready(i, grads_for(comm.rank)[i])
        with pytest.raises(RuntimeError) as at_end:
            reducer.finalize()
        with pytest.raises(RuntimeError) as checked:  # DDP's _check_reducer_finalized
            reducer.check_finalized()
        with pytest.raises(RuntimeError) as at_next:
            reducer.prepare_for_backward()
        return str(at_end.value), str(checked.value), str(at_next.value)

    for rank, (at_end, checked, at_next) in enumerate(spawn(body, 2)):
        assert checked == at_next
        for text in (at_end, at_next):
            assert f"Parameters which did not receive grad for rank {rank}: b.bias" in text
        assert "Expected to have finished reduction in the prior iteration" in at_next


def test_no_sync_hooks_do_nothing_and_accumulated_grads_are_reduced_later() -> None:
    def body(comm: ReferenceComm) -> tuple[dict[int, np.ndarray], int]:
        got: dict[int, np.ndarray] = {}
        reducer = make_reducer(comm, TWO_BUCKETS, got)
        g = grads_for(comm.rank)
        for i in range(4):  # under no_sync: no prepare_for_backward, hooks are no-ops
            reducer.mark_ready(i, g[i])
        reducer.finalize()
        synced_before = len(reducer.records)
        reducer.prepare_for_backward()
        for i in (3, 2, 1, 0):
            reducer.mark_ready(i, g[i] + g[i])  # what autograd accumulated over two steps
        reducer.finalize()
        return got, synced_before

    results = spawn(body, 2)
    half = np.float32(0.5)
    for got, synced_before in results:
        assert synced_before == 0
        for i in range(4):
            a, b = grads_for(0)[i], grads_for(1)[i]
            np.testing.assert_array_equal(got[i], (a + a) * half + (b + b) * half)


def test_rebuild_once_from_rank_zeros_ready_order() -> None:
    def body(comm: ReferenceComm) -> tuple[bool, bool, BucketPlan]:
        reducer = make_reducer(
            comm, BucketPlan(((0, 1, 2, 3),), (1 << 30,)), {}, rebuild_limits=(12, 24)
        )
        reducer.prepare_for_backward()
        # Ranks observe different orders; rank 0's decides for everyone.
        order = (3, 2, 1, 0) if comm.rank == 0 else (0, 1, 2, 3)
        for i in order:
            reducer.mark_ready(i, grads_for(comm.rank)[i])
        reducer.finalize()
        first = reducer.rebuild_buckets()
        second = reducer.rebuild_buckets()
        return first, second, reducer.plan

    want = assign_buckets([12, 16, 20, 4], [12, 24], order=[3, 2, 1, 0])
    for first, second, plan in spawn(body, 2):
        assert (first, second) == (True, False)
        assert plan == want


def test_gradient_as_bucket_view_divides_in_place() -> None:
    def body(comm: ReferenceComm) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
        got: dict[int, np.ndarray] = {}
        reducer = make_reducer(comm, TWO_BUCKETS, got, gradient_as_bucket_view=True)
        views = reducer.bucket_views()
        reducer.prepare_for_backward()
        for i in (3, 2, 1, 0):
            views[i][...] = grads_for(comm.rank)[i]  # autograd accumulated into the view
            reducer.mark_ready(i, views[i])
        reducer.finalize()
        return views, got

    want = [grads_for(0)[i] / np.float32(2) + grads_for(1)[i] / np.float32(2) for i in range(4)]
    for views, got in spawn(body, 2):
        for i in range(4):
            np.testing.assert_array_equal(views[i], want[i])
            assert np.shares_memory(got[i], got[i])  # written back as the bucket view
            np.testing.assert_array_equal(got[i], want[i])


def test_static_graph_learns_unused_in_first_iteration() -> None:
    def body(comm: ReferenceComm) -> list[dict[int, np.ndarray]]:
        got: dict[int, np.ndarray] = {}
        reducer = make_reducer(comm, TWO_BUCKETS, got, static_graph=True)
        steps = []
        for _ in range(3):
            reducer.rebuild_buckets()
            reducer.prepare_for_backward()
            for i in (2, 1, 0):  # parameter 3 is never used
                reducer.mark_ready(i, grads_for(comm.rank)[i])
            reducer.finalize()
            steps.append(dict(got))
        assert reducer.has_rebuilt_buckets
        return steps

    want = expected_mean(2)
    for steps in spawn(body, 2):
        for got in steps:
            assert sorted(got) == [0, 1, 2]
            for i in got:
                np.testing.assert_array_equal(got[i], want[i])


def test_static_graph_rebuilds_from_its_second_iteration_unused_last() -> None:
    # As DDP: the first (delayed) iteration records no order; the second one's order is
    # the plan's, with the unused parameter (3), marked first, put last.
    def body(comm: ReferenceComm) -> tuple[bool, tuple[int, ...]]:
        reducer = make_reducer(comm, TWO_BUCKETS, {}, static_graph=True, rebuild_limits=(8,))
        rebuilt = []
        for order in ((0, 1, 2), (2, 1, 0), (0, 2, 1)):
            rebuilt.append(reducer.rebuild_buckets())
            reducer.prepare_for_backward()
            for i in order:
                reducer.mark_ready(i, grads_for(comm.rank)[i])
            reducer.finalize()
        assert rebuilt == [False, False, True]
        return reducer.has_rebuilt_buckets, tuple(i for b in reducer.plan.buckets for i in b)

    assert spawn(body, 1) == [(True, (2, 1, 0, 3))]


def _hook_arithmetic(name: str, world: int, i: int) -> np.ndarray:
    """What the hook must produce, written out: compress, divide, sum in rank order."""
    import ml_dtypes

    low = {"allreduce": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}[name]
    parts = [grads_for(r)[i].astype(low) / low(world) for r in range(world)]
    total = parts[0]
    for p in parts[1:]:
        total = (total + p).astype(low)
    return total.astype(np.float32)


@pytest.mark.parametrize("name", sorted(HOOKS))
@pytest.mark.parametrize("world", [2, 3])
def test_backend_neutral_hooks(name: str, world: int) -> None:
    def body(comm: ReferenceComm) -> dict[int, np.ndarray]:
        got: dict[int, np.ndarray] = {}
        reducer = make_reducer(comm, TWO_BUCKETS, got, hook=HOOKS[name](comm))
        reducer.prepare_for_backward()
        for i in (3, 2, 1, 0):
            reducer.mark_ready(i, grads_for(comm.rank)[i])
        reducer.finalize()
        return got

    for got in spawn(body, world):
        for i in range(4):
            np.testing.assert_array_equal(got[i], _hook_arithmetic(name, world, i))
    if name != "allreduce":  # compression loses precision, and the loss is visible
        exact = expected_mean(world)
        assert any(not np.array_equal(got[i], exact[i]) for i in range(4))


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda c: make_reducer(c, BucketPlan(((0, 1),), (8,)), {}), "covers 2 parameters"),
        (
            lambda c: Reducer(
                [np.zeros(2, np.float32), np.zeros(2, np.float64)],
                BucketPlan(((0, 1),), (64,)),
                c,
                NumpyOps(),
                set_grad=lambda i, v: None,
            ),
            "bucket 0 of the plan mixes",
        ),
    ],
)
def test_bad_construction(build: Callable[[ReferenceComm], Any], needle: str) -> None:
    with pytest.raises(RankError) as err:
        spawn(build, 1)
    assert isinstance(err.value.__cause__, ValueError)
    assert needle in str(err.value.__cause__)


def test_unused_without_find_unused_is_refused() -> None:
    def body(comm: ReferenceComm) -> None:
        make_reducer(comm, TWO_BUCKETS, {}).prepare_for_backward([2])

    with pytest.raises(RankError) as err:
        spawn(body, 1)
    assert "['b.weight'] but find_unused_parameters is off" in str(err.value.__cause__)


def _one_iteration(reducer: Reducer, rank: int, unused: Sequence[int] = ()) -> None:
    reducer.rebuild_buckets()
    reducer.prepare_for_backward(unused)
    for i in range(len(SHAPES)):
        if i not in unused:
            reducer.mark_ready(i, grads_for(rank)[i])
    reducer.finalize()


def test_rebuild_off_keeps_the_plan_given() -> None:
    def body(comm: ReferenceComm) -> tuple[bool, BucketPlan]:
        reducer = make_reducer(comm, TWO_BUCKETS, {}, rebuild=False)
        for _ in range(3):
            _one_iteration(reducer, comm.rank)
        return reducer.has_rebuilt_buckets, reducer.plan

    for rebuilt, plan in spawn(body, 2):
        assert not rebuilt and plan == TWO_BUCKETS


def test_hook_installs_once_and_only_between_iterations() -> None:
    def body(comm: ReferenceComm) -> list[str]:
        errors = []
        reducer = make_reducer(comm, TWO_BUCKETS, {})
        reducer.register_hook(HOOKS["allreduce"](comm))
        for again in (lambda: reducer.register_hook(HOOKS["allreduce"](comm)),):
            with pytest.raises(RuntimeError) as err:
                again()
            errors.append(str(err.value))
        during = make_reducer(comm, TWO_BUCKETS, {})
        during.prepare_for_backward()
        with pytest.raises(RuntimeError) as err:
            during.register_hook(HOOKS["allreduce"](comm))
        errors.append(str(err.value))
        late = make_reducer(comm, TWO_BUCKETS, {})
        _one_iteration(late, comm.rank)
        late.register_hook(HOOKS["allreduce"](comm))  # between iterations: PyTorch's DDP too
        with pytest.raises(RuntimeError) as err:
            late.set_static_graph()
        errors.append(str(err.value))
        return errors

    once, hook_during, static_late = spawn(body, 1)[0]
    assert "can only be called once" in once
    assert "cannot be called while a backward pass is expected or under way (rank 0)" in (
        hook_during
    )
    assert "set_static_graph() should be called before training loop starts" in static_late


def test_skip_all_reduce_unused_params_launches_no_reduction_for_unused_buckets() -> None:
    def body(comm: ReferenceComm) -> tuple[dict[int, np.ndarray], list[float]]:
        got: dict[int, np.ndarray] = {}
        reducer = make_reducer(
            comm,
            TWO_BUCKETS,
            got,
            find_unused_parameters=True,
            skip_all_reduce_unused_params=True,
        )
        _one_iteration(reducer, comm.rank, unused=(2, 3))
        return got, list(reducer.records[-1].launch_times)

    for got, launches in spawn(body, 2):
        assert sorted(got) == [0, 1]  # b (bucket 0) unused everywhere: untouched
        assert launches[0] == 0.0 and launches[1] > 0  # bucket 0 never launched
        for i in (0, 1):
            np.testing.assert_array_equal(got[i], expected_mean(2)[i])


@pytest.mark.parametrize("world", [2, 3])
def test_batched_grad_copy_divides_the_bucket_once(world: int) -> None:
    def body(comm: ReferenceComm) -> dict[int, np.ndarray]:
        got: dict[int, np.ndarray] = {}
        _one_iteration(make_reducer(comm, TWO_BUCKETS, got, batched_grad_copy=True), comm.rank)
        return got

    for got in spawn(body, world):
        for i in range(4):
            total = sum(grads_for(r)[i] for r in range(world))
            want = (total / np.float32(world)).astype(np.float32)
            np.testing.assert_allclose(got[i], want, rtol=1e-6)


def test_sparse_parameter_cannot_share_a_bucket() -> None:
    def body(comm: ReferenceComm) -> None:
        make_reducer(comm, TWO_BUCKETS, {}, sparse=[False, False, True, False])

    with pytest.raises(RankError) as err:
        spawn(body, 1)
    assert "bucket 0 of the plan holds [2, 3]: a parameter with a sparse gradient" in str(
        err.value.__cause__
    )


def test_mark_many_makes_the_marks_of_one_mark_ready_each() -> None:
    """Logged arrivals marked in one call: same order, results and errors."""

    def body(comm: ReferenceComm) -> tuple[list[Any], list[dict[int, np.ndarray]], str]:
        results: list[dict[int, np.ndarray]] = [{}, {}]
        records = []
        g = grads_for(comm.rank)
        order = (1, 0, 2) if comm.rank == 0 else (1, 0, 3, 2)
        for got, batched in zip(results, (False, True), strict=True):
            reducer = make_reducer(comm, TWO_BUCKETS, got, find_unused_parameters=True)
            reducer.prepare_for_backward([3] if comm.rank == 0 else [])
            if batched:
                reducer.mark_many(order[:-1], [g[i] for i in order[:-1]])
                reducer.mark_ready(order[-1], g[order[-1]])
            else:
                for i in order:
                    reducer.mark_ready(i, g[i])
            reducer.finalize()
            records.append(reducer.records[-1])
        reducer.prepare_for_backward()
        reducer.mark_many([2], [g[2]])
        try:
            reducer.mark_many([0, 2], [g[0], g[2]])
            error = ""
        except RuntimeError as exc:
            error = f"{reducer.marking}: {exc}"
        return records, results, error

    for records, (one, many), error in spawn(body, 2):
        assert records[0].ready_order == records[1].ready_order
        assert records[0].unused == records[1].unused
        assert sorted(one) == sorted(many)
        for i in one:
            np.testing.assert_array_equal(many[i], one[i])
        assert error.startswith("2: ") and "marked as ready twice" in error


def test_set_grads_writes_a_whole_bucket_unless_a_member_is_left_alone() -> None:
    def body(comm: ReferenceComm) -> tuple[list[tuple[int, ...]], dict[int, np.ndarray]]:
        got: dict[int, np.ndarray] = {}
        calls: list[tuple[int, ...]] = []

        def set_grads(indices: Sequence[int], views: Sequence[np.ndarray]) -> None:
            calls.append(tuple(indices))
            for i, v in zip(indices, views, strict=True):
                got[i] = np.array(v)

        reducer = make_reducer(
            comm, TWO_BUCKETS, got, find_unused_parameters=True, set_grads=set_grads
        )
        reducer.prepare_for_backward([3])  # no rank uses 3: bucket (2, 3) member by member
        for i in (2, 1, 0):
            reducer.mark_ready(i, grads_for(comm.rank)[i])
        reducer.finalize()
        return calls, got

    want = expected_mean(2)
    for calls, got in spawn(body, 2):
        assert calls == [(0, 1)]
        assert sorted(got) == [0, 1, 2]
        for i in got:
            np.testing.assert_array_equal(got[i], want[i])


@pytest.mark.parametrize("converted", [(0, 1, 2, 3), (0,)])
def test_relayout_makes_the_buckets_again_for_the_parameters_new_dtype(
    converted: tuple[int, ...],
) -> None:
    """Parameters converted after the reducer was made (a backend's ``ddp.double()``):
    the buckets follow, re-planned where one would mix dtypes; nothing changed, nothing
    is made again."""

    def body(comm: ReferenceComm) -> tuple[bool, bool, dict[int, np.ndarray], BucketPlan]:
        got: dict[int, np.ndarray] = {}
        reducer = make_reducer(comm, TWO_BUCKETS, got)
        unchanged = reducer.relayout()
        for i in converted:
            reducer.params[i] = reducer.params[i].astype(np.float64)
        changed = reducer.relayout()
        reducer.prepare_for_backward()
        for i in (3, 2, 1, 0):
            dtype = np.float64 if i in converted else np.float32
            reducer.mark_ready(i, grads_for(comm.rank, dtype)[i])
        reducer.finalize()
        return unchanged, changed, got, reducer.plan

    for unchanged, changed, got, plan in spawn(body, 2):
        assert (unchanged, changed) == (False, True)
        for bucket in plan.buckets:  # no bucket mixes dtypes
            assert len({i in converted for i in bucket}) == 1
        for i in range(len(SHAPES)):
            dtype = np.float64 if i in converted else np.float32
            assert got[i].dtype == dtype
            np.testing.assert_array_equal(got[i], expected_mean(2, dtype)[i])


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize(
    "options",
    [{}, {"batched_grad_copy": True}, {"gradient_as_bucket_view": True}, {"static_graph": True}],
)
def test_a_gradient_of_another_dtype_than_its_bucket_is_refused(
    big: bool, options: dict[str, bool]
) -> None:
    """Parameters converted behind the reducer's back (a module converted after its DDP
    was made): their float64 gradients were copied into the float32 bucket and rounded,
    without a word. As PyTorch's reducer, the bucket refuses them, naming the parameter
    and both dtypes; on each copy path (a large gradient is copied in as it arrives, a
    static graph's first pass copies at its end) and with nothing reduced."""
    size = 1 << 14 if big else 3  # from 2**14 elements a gradient is copied on arrival

    def body(comm: ReferenceComm) -> tuple[str, dict[int, np.ndarray]]:
        got: dict[int, np.ndarray] = {}
        params = [np.zeros(size, np.float32), np.zeros(2, np.float32)]
        plan = BucketPlan(((0, 1),), (1 << 20,))
        reducer = Reducer(
            params, plan, comm, NumpyOps(), names=["w", "b"], set_grad=got.__setitem__, **options
        )
        reducer.prepare_for_backward()
        try:
            reducer.mark_ready(1, np.ones(2, np.float32))
            reducer.mark_ready(0, np.full(size, 1 / 3, np.float64))
            reducer.finalize()
        except RuntimeError as exc:
            return str(exc), got
        return "", got

    for error, got in spawn(body, 1):
        assert error.startswith(
            "The gradient of parameter at index 0 with name w is float64 but its bucket "
            "holds float32 on rank 0: the module's parameters were converted"
        ), error
        assert got == {}
