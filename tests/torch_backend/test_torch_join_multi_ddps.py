"""Two DDPs in one xgrad ``Join`` with uneven inputs and gradient accumulation: the matrix.

Gloo ranks, one run per world size (2 and 3) running every scenario. Rank ``r`` has
``BATCHES[world][r]`` steps (the rank that trains longest is not always the highest, so
the rank buffers come from changes as ranks join). Step ``i`` runs, for each DDP,
``acc(i)`` ``no_sync`` passes then a synchronised one, each a forward and a backward pass
of its own micro-batch, the DDPs' passes interleaved micro-batch by micro-batch
(``sequential``: all of ``d1``'s, then all of ``d2``'s). Every step's gradients and the
final parameters and buffers are compared:

* with PyTorch's DDPs under PyTorch's ``Join`` on the same models, seeds and data, bit
  for bit, where PyTorch's can run the scenario: every DDP runs the same number of
  passes per step, interleaved (``*_aligned``);
* elsewhere with :func:`join_matrix.reference` (PyTorch's DDP semantics, computed in one
  process; the scaffolding is :mod:`join_matrix`'s, shared with the three-DDP matrix),
  within 1e-6. PyTorch's own ``Join`` cannot be the reference there: its joined rank
  shadows one pass of each DDP per count (the first DDP's forward pass), so where the
  DDPs run different numbers of passes in a step, or one DDP's passes all before the
  other's, it pairs one DDP's collectives with another's and gloo aborts the processes
  ("Received data size doesn't match expected size"); with ``static_graph`` and
  ``no_sync`` under its ``Join`` its reducer fails an internal assert
  (``expect_autograd_hooks_``).

``divide_by_initial_world_size=False`` (``effective_*``): PyTorch's ``Join`` gives the
number of ranks still training to the first joinable only (its forward pass counts
them); a second DDP in the same context divides by the world size all the same, and
xgrad's does as PyTorch's (``effective_aligned``, bit for bit); the reference does too.

Before (:mod:`xgrad.torch_backend.join_absent`), every scenario where the DDPs' passes
per step differ (``every_other``, ``different``, ``sequential``) failed: the joined rank
waited in ``d2``'s announcement while the ranks still training counted at ``d1``'s next
pass, to the timeout; or, ``d2`` running twice without ``d1``, every rank raised the
join order's refusal.

``*_slowed``: rank 0 sleeps before each pass, as on a loaded machine. There the run of
three ranks failed now and then, every rank raising the join order's refusal ("rank r ran
DDP 1's forward pass before DDP 0's") at the first count of a rank that had just joined:
``d2``'s forward passes are noted in the store once one came before ``d1``'s (step 1 of
``different``: ``d2``'s ``no_sync`` pass first), and the note of ``d2``'s synchronised
pass after its ``no_sync`` one named the step before the one it began, where that pass
began none (it goes on with the ``no_sync`` pass's). The joined rank, its count waiting
past a poll for a slower rank, took that note, of a pass it had run itself, for one
it had not shadowed, and refused. The note now names the step before the pass's own.

The DDP timeout is short (:data:`TIMEOUT`): a hang fails the run quickly.
"""

from __future__ import annotations

from typing import Any

import pytest
from join_matrix import EFFECTIVE, STATIC, UNUSED, Scenario, check_scenario, launch

TIMEOUT = 10.0
BATCHES = {2: (4, 2), 3: (4, 2, 3)}

ALIGNED = ((1, 0, 2, 1), (1, 0, 2, 1))
EVERY_OTHER = ((1, 0, 1, 0), (0, 0, 0, 0))  # d1 accumulates every other step, d2 never
DIFFERENT = ((2, 0, 1, 1), (0, 1, 2, 0))

SCENARIOS: dict[str, Scenario] = {
    "linear_aligned": Scenario("linear", ALIGNED, True),
    "linear_every_other": Scenario("linear", EVERY_OTHER, False),
    "linear_different": Scenario("linear", DIFFERENT, False),
    "linear_sequential": Scenario("linear", ALIGNED, False, sequential=True),
    "normed_aligned": Scenario("normed", ALIGNED, True),
    "normed_every_other": Scenario("normed", EVERY_OTHER, False),
    "normed_different": Scenario("normed", DIFFERENT, False),
    "unused_aligned": Scenario("branches", ALIGNED, True, UNUSED),
    "unused_every_other": Scenario("branches", EVERY_OTHER, False, UNUSED),
    "unused_different": Scenario("branches", DIFFERENT, False, UNUSED),
    "static_aligned": Scenario("linear", ALIGNED, False, STATIC),
    "static_every_other": Scenario("linear", EVERY_OTHER, False, STATIC),
    "effective_aligned": Scenario("linear", ALIGNED, True, join_kw=EFFECTIVE),
    "effective_every_other": Scenario("linear", EVERY_OTHER, False, join_kw=EFFECTIVE),
    "effective_normed": Scenario("normed", DIFFERENT, False, join_kw=EFFECTIVE),
    "different_slowed": Scenario("linear", DIFFERENT, False, slow=0.05),
    "sequential_slowed": Scenario("linear", ALIGNED, False, sequential=True, slow=0.05),
}


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    return launch(SCENARIOS, BATCHES, request.param, TIMEOUT, limit=120)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_gradients_and_final_model_as_pytorchs_ddp(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    check_scenario(SCENARIOS[name], name, BATCHES[world], results)
