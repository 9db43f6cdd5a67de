"""Three DDPs in one xgrad ``Join`` with uneven inputs: a DDP skipped for whole steps, and buffers.

The scaffolding and the reference are :mod:`join_matrix`'s (the two-DDP matrix's,
generalised); gloo ranks, one run per world size (2 and 3) running every scenario, each
step's gradients and the final parameters and buffers compared with PyTorch's DDPs
under PyTorch's ``Join`` (``three_*aligned``, bit for bit: every DDP runs the same
passes) or with the reference. ``None`` in a schedule: that DDP runs no pass in the step.

* ``middle_*``: ``d2`` runs on some steps or none while ``d3``, after it, runs on every
  one (``d1, d3, d1, d3, ...``; ``d1, d2, d3`` on some steps, ``d1, d3`` on others);
  ``three_different``: three accumulation patterns; ``*_sequential``: each DDP's passes
  of a step all before the next DDP's.
* ``stand_in_*``: "stand-in buffer sync". Once a rank has joined, a DDP that runs no pass
  in a step is stood in for (:mod:`xgrad.torch_backend.join_absent`): the ranks still
  training send what its forward pass would, buffer broadcast included, so that the
  joined rank's shadow stays in step. Rank 1 of 3 joins at step 2 and rank 2, the
  highest still training, at step 3. A DDP with BatchNorm buffers skipped at step 2 (or
  ``d1``, stood in for when ``d2`` runs twice in a step) had rank 2's buffers broadcast
  over rank 0's by the stand-in; at its next real pass rank 0, the highest still
  training then, broadcast those instead of its own (PyTorch's DDP runs no broadcast
  for a DDP that runs no pass): the final buffers differed from PyTorch's semantics
  (``stand_in_middle``, ``_last``, ``_first``, ``_effective``). Two ranks cannot show it
  (after the first join one rank trains). Now the stand-in's broadcast lands in copies
  that are thrown away.

Before, every scenario but the aligned ones and ``stand_in_skipped_first`` hung to the
timeout on three ranks (and the ``middle_*`` ones on two): the
joined rank shadows ``d1, d2, d3`` in turn per count, and the ranks still training went
on to ``d3`` (or back to ``d1``'s count, or out of the loop) with ``d2``'s (or ``d3``'s)
place in that cycle not stood in for.

Left as it is (so no schedule here has it): a later DDP's pass before ``d1``'s in the
iteration at which the *first* rank joins (the ranks still training learn of it at
``d1``'s count, after that pass) is refused on every rank at once
(:mod:`xgrad.torch_backend.join_order`), as with two DDPs; once a rank has joined, a
later DDP leading an iteration is stood in for (step 4 of ``middle_sometimes``). So both
world sizes have their first join at step 2, where ``d1`` leads.

The DDP timeout is short (:data:`TIMEOUT`): a hang fails the run quickly.
"""

from __future__ import annotations

from typing import Any

import pytest
from join_matrix import EFFECTIVE, STATIC, UNUSED, Scenario, check_scenario, launch

TIMEOUT = 10.0
#: with 3 ranks, rank 1 joins at step 2, then rank 2 (the highest still training) at 3
BATCHES = {2: (2, 5), 3: (5, 2, 3)}

N = None
ALIGNED = ((1, 0, 2, 1, 0),) * 3
MIDDLE_NEVER = ((1, 0, 2, 1, 0), (N, N, N, N, N), (0, 1, 0, 0, 2))
MIDDLE_SOMETIMES = ((0, 1, 1, 2, 0), (0, N, 1, N, N), (1, 0, 0, 1, 1))
DIFFERENT = ((2, 0, 1, 1, 0), (0, 1, 2, 0, 1), (1, 2, 0, 0, 3))
SKIPPING_SEQUENTIAL = ((1, 0, 2, 1, 0), (0, N, 1, N, 0), (1, 1, 0, 2, 0))
# a DDP with buffers skipped once a rank joined, before the highest one joins
MIDDLE_STOOD_IN = ((0, 0, 0, 0, 0), (0, 1, N, 0, 1), (1, 0, 0, 1, 0))
LAST_STOOD_IN = ((0, 0, 0, 1, 0), (1, 0, 0, 1, 0), (0, 1, N, N, 0))
# sequential, d2 running twice a step: d1 stood in for at d2's second pass
FIRST_STOOD_IN = ((0, 0, 0, 0, 0), (1, 1, 1, 1, 1), (0, 0, 0, 0, 0))
# d1 runs no pass at step 3: its count stood in for at d2's pass
FIRST_SKIPPED = ((0, 1, 1, N, 0), (0, 0, 1, 0, 0), (1, 0, 0, 1, 0))

SCENARIOS: dict[str, Scenario] = {
    "three_aligned": Scenario("linear", ALIGNED, True),
    "three_normed_aligned": Scenario("normed", ALIGNED, True),
    "middle_never": Scenario("linear", MIDDLE_NEVER, False),
    "middle_sometimes": Scenario("linear", MIDDLE_SOMETIMES, False),
    "three_different": Scenario("linear", DIFFERENT, False),
    "middle_sequential": Scenario("linear", SKIPPING_SEQUENTIAL, False, sequential=True),
    "middle_unused": Scenario("branches", MIDDLE_SOMETIMES, False, UNUSED),
    "middle_static": Scenario("linear", MIDDLE_SOMETIMES, False, STATIC),
    "middle_effective": Scenario("linear", DIFFERENT, False, join_kw=EFFECTIVE),
    "normed_different": Scenario("normed", DIFFERENT, False),
    "stand_in_middle": Scenario("normed", MIDDLE_STOOD_IN, False),
    "stand_in_last": Scenario("normed", LAST_STOOD_IN, False),
    "stand_in_first": Scenario("normed", FIRST_STOOD_IN, False, sequential=True),
    "stand_in_skipped_first": Scenario("normed", FIRST_SKIPPED, False),
    "stand_in_effective": Scenario("normed", MIDDLE_STOOD_IN, False, join_kw=EFFECTIVE),
}


@pytest.fixture(scope="module", params=[2, 3])
def outcome(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    return launch(SCENARIOS, BATCHES, request.param, TIMEOUT, limit=150)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_gradients_and_final_model_as_pytorchs_ddp(
    outcome: tuple[int, dict[int, Any]], name: str
) -> None:
    world, results = outcome
    check_scenario(SCENARIOS[name], name, BATCHES[world], results)
