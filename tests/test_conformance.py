"""One battery for every registered backend: the same tests, whatever the backend.

Parametrised over ``xgrad.list_backends()`` — the built-in reference, torch and JAX
backends and any installed through the ``xgrad.backends`` entry points (the example
``examples/ring_backend``, installed by ``make setup``) — and over every runner they list:

- the backend's shape: a name, ``available()``, runners that declare hooks and dtypes;
- ``Comm`` semantics (JAX's ranks are threads with a device each, summing with a
  ``psum``): allreduce sums exactly,
  in-flight collectives complete in any wait order, broadcast and allgather by rank, a
  failing rank is named and the next run works;
- ``ArrayOps``: the reducer's in-place array operations (skipped, with the reason, for a
  backend whose arrays are immutable: JAX);
- a runner's gradients against the float64 truth, within the dtype's tolerance, for a
  plan of one bucket per parameter in a scrambled order; the plan it reports covers the
  step's parameters, and a runner reports which plan it ran.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import pytest

from xgrad import models as zoo
from xgrad.backend import (
    Comm,
    backend_available,
    get_backend,
    list_backends,
    runner_entries,
    unsupported_by_declaration,
)
from xgrad.buckets import BucketPlan
from xgrad.hooks import HOOK_NAMES
from xgrad.reference import single_process_grads
from xgrad.step import Step, make_step

#: the example backend this repository's setup installs (``examples/ring_backend``).
EXAMPLE = "ring"
#: how long a collective in these tests may wait (a few seconds; nothing should).
TIMEOUT_S = 60.0

BACKENDS = list_backends()
ENTRIES = [e for e in runner_entries(check=False, every=True) if e.runner is not None]


def _usable(name: str) -> Any:
    ok, why = backend_available(name)
    if not ok:
        pytest.skip(f"backend {name} cannot run here: {why}")
    return get_backend(name)


def test_the_example_backend_is_installed() -> None:
    """``make setup`` installs ``examples/ring_backend``; it registers through its entry point."""
    assert EXAMPLE in BACKENDS, (
        f"backend {EXAMPLE!r} is not registered: install the example with "
        "`pip install -e examples/ring_backend` (make setup does)"
    )
    assert [e.name for e in runner_entries([EXAMPLE], check=False)] == [EXAMPLE]


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_declares_what_it_runs(name: str) -> None:
    backend = get_backend(name)
    assert backend.name == name
    assert isinstance(backend.available(), bool)
    runners = list(backend.runners())
    assert runners, f"backend {name} lists no runners"
    for runner in runners:
        assert runner.name and runner.description
        assert set(runner.hooks) <= set(HOOK_NAMES), runner.hooks
        assert runner.dtypes and set(runner.dtypes) <= set(zoo.DTYPES), runner.dtypes
    all_names = [e.name for e in runner_entries(check=False, every=True)]
    assert len(all_names) == len(set(all_names)), f"runner names collide: {all_names}"


def _scenario(name: str, comm: Comm) -> dict[str, Any]:
    """Every rank of a world of 3: exact sums, any wait order, objects by rank."""
    pair = get_backend(name).array_ops()
    # A backend without in-place array operations (JAX) takes NumPy arrays as they are.
    native, to_numpy = (pair[1], pair[0].to_numpy) if pair is not None else (np.asarray, np.asarray)
    r = comm.rank
    # Integers in float32 sum exactly in any order, so every backend must give these bits.
    first = comm.allreduce(native(np.arange(6, dtype=np.float32) * (r + 1)))
    second = comm.allreduce(native(np.full((2, 3), 10.0**r, dtype=np.float64)))
    late = to_numpy(second.wait())  # waited in the reverse order of the launches
    early = to_numpy(first.wait())
    return {
        "rank": comm.rank,
        "size": comm.size,
        "first": early,
        "second": late,
        "broadcast": comm.broadcast_object({"from": r, "list": [r] * r}, src=1),
        "gathered": comm.allgather_object(("rank", r)),
    }


def _fail_on_rank_1(comm: Comm) -> int:
    if comm.rank == 1:
        raise ValueError("rank 1 says no")
    comm.allgather_object(comm.rank)  # rank 0 would wait for rank 1 here, but not forever
    return comm.rank


def _gather_ranks(comm: Comm) -> list[Any]:
    return comm.allgather_object(comm.rank)


def _comm_backend(name: str) -> Any:
    backend = _usable(name)
    if backend.run_ranks is None:
        pytest.skip(f"backend {name} has no process group object (Comm); it reduces otherwise")
    return backend


@pytest.mark.parametrize("name", BACKENDS)
def test_comm_semantics(name: str) -> None:
    backend = _comm_backend(name)
    results = backend.run_ranks(functools.partial(_scenario, name), 3, timeout=TIMEOUT_S)
    assert [res["rank"] for res in results] == [0, 1, 2]
    for res in results:
        assert res["size"] == 3
        assert res["first"].dtype == np.float32 and res["first"].shape == (6,)
        np.testing.assert_array_equal(res["first"], np.arange(6, dtype=np.float32) * 6)
        assert res["second"].dtype == np.float64 and res["second"].shape == (2, 3)
        np.testing.assert_array_equal(res["second"], np.full((2, 3), 111.0))
        assert res["broadcast"] == {"from": 1, "list": [1]}
        assert res["gathered"] == [("rank", 0), ("rank", 1), ("rank", 2)]


@pytest.mark.parametrize("name", BACKENDS)
def test_comm_failure_is_named_and_bounded_and_the_next_run_works(name: str) -> None:
    backend = _comm_backend(name)
    start = time.monotonic()
    with pytest.raises(Exception) as err:
        backend.run_ranks(_fail_on_rank_1, 2, timeout=TIMEOUT_S)
    assert "rank 1" in str(err.value) and "rank 1 says no" in str(err.value)
    assert time.monotonic() - start < TIMEOUT_S  # the peer did not wait out its timeout
    assert backend.run_ranks(_gather_ranks, 2, timeout=TIMEOUT_S) == [[0, 1], [0, 1]]


@pytest.mark.parametrize("name", BACKENDS)
def test_array_ops(name: str) -> None:
    backend = _usable(name)
    pair = backend.array_ops()
    if pair is None:
        pytest.skip(f"backend {name} has no in-place array operations (its arrays are immutable)")
    ops, native = pair
    a = native(np.arange(6, dtype=np.float32).reshape(2, 3))
    b = native(np.ones(4, dtype=np.float64))
    assert ops.numel(a) == 6 and ops.nbytes(a) == 24 and ops.nbytes(b) == 32
    assert ops.key(a) != ops.key(b) and ops.key(a) == ops.key(native(np.zeros(1, np.float32)))
    flat = ops.new_flat([a], 10)
    np.testing.assert_array_equal(ops.to_numpy(flat), np.zeros(10, np.float32))
    view = ops.view(flat, 4, a)
    ops.copy_to(view, a, scale=1 / 3)
    expected = np.arange(6, dtype=np.float32).reshape(2, 3) * np.float32(1 / 3)
    np.testing.assert_array_equal(ops.to_numpy(view), expected)  # the dtype's rounding
    np.testing.assert_array_equal(ops.to_numpy(flat)[4:], expected.reshape(-1))  # writes through
    assert ops.is_view_of(view, view) and not ops.is_view_of(a, view)
    ops.div_(view, 2)
    np.testing.assert_array_equal(ops.to_numpy(view), expected / np.float32(2))
    ops.zero_(view)
    assert not ops.to_numpy(flat).any()
    back = ops.from_numpy(np.full(3, 7.0, np.float32), a)
    np.testing.assert_array_equal(ops.to_numpy(back), np.full(3, 7.0, np.float32))


def _scrambled_step() -> Step:
    """The MLP in float32 at world size 2, one bucket per parameter in a scrambled order."""
    step = make_step("mlp", world_size=2, dtype="float32", steps=1, timeout=TIMEOUT_S)
    order = (2, 5, 0, 3, 1, 4)
    plan = BucketPlan(
        tuple((i,) for i in order),
        tuple(int(step.weights[k].nbytes) for k in [list(step.weights)[i] for i in order]),
    )
    return Step(step.model, step.weights, step.x, step.y, 2, plan, None, 1, TIMEOUT_S)


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_runner_against_the_float64_truth(entry: Any) -> None:
    _usable(entry.backend)
    runner = entry.runner
    step = _scrambled_step()
    reason = runner.unsupported(step)
    assert reason is None, f"{runner.name} should run the float32 MLP at world size 2: {reason}"
    wide = {k: v.astype(np.float64) for k, v in step.weights.items()}
    truth = single_process_grads(wide, step.x.astype(np.float64), step.y.astype(np.float64))
    result = runner.run(step)
    assert list(result.grads) == list(step.weights)
    for key, exact in truth.items():
        got = result.grads[key]
        assert got.dtype == np.float32 and got.shape == exact.shape, key
        rel = np.abs(got.astype(np.float64) - exact).max() / np.abs(exact).max()
        assert rel <= 1e-6, f"{runner.name}: {key} rel {rel:.3g} beyond float32's 1e-6"
    assert result.seconds_per_step > 0
    # Plan fidelity: the plan it reports is a plan of exactly these parameters (None: it
    # reduces without a bucket plan, as JAX's own jit reduction does, and says so).
    if result.plan is not None:
        covered = sorted(i for b in result.plan.buckets for i in b)
        assert covered == list(range(len(step.weights))), f"{runner.name}: {result.plan}"
    else:
        assert "no plan" in runner.description, f"{runner.name} does not say which plan it ran"


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_runner_says_why_not(entry: Any) -> None:
    runner = entry.runner
    step = _scrambled_step()
    for hook in (h for h in HOOK_NAMES if h not in runner.hooks):
        bad = Step(step.model, step.weights, step.x, step.y, 2, step.plan, hook)
        reason = runner.unsupported(bad)
        assert reason and hook in reason, (runner.name, hook, reason)
    for dtype in (d for d in zoo.DTYPES if d not in runner.dtypes):
        weights = {k: v.astype(zoo.as_dtype(dtype)) for k, v in step.weights.items()}
        bad = Step(step.model, weights, step.x, step.y, 2, step.plan)
        reason = runner.unsupported(bad)
        assert reason and dtype in reason, (runner.name, dtype, reason)
    assert unsupported_by_declaration(runner, step) is None


def test_jax_says_why_not_for_more_ranks_than_devices() -> None:
    """A world size is a "why not" too: JAX needs one device per rank."""
    jax_runners = [e.runner for e in ENTRIES if e.backend == "jax"]
    if not jax_runners:
        pytest.skip("no JAX backend registered")
    _usable("jax")
    step = _scrambled_step()
    big = Step(step.model, step.weights, step.x, step.y, 4096, step.plan)
    for runner in jax_runners:
        reason = runner.unsupported(big)
        assert reason is not None and "world size 4096 needs 4096 JAX CPU devices" in reason
