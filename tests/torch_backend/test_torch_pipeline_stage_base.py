"""The helpers a stage's passes share, on a bare :class:`StageState` (no process group):
which module and device a stage has, the forward with its loss, no_sync's placement."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import xgrad.pipeline as xp  # noqa: E402
from xgrad.torch_backend.pipeline_stage_base import StageState  # noqa: E402


def _state(no_sync: Any = None) -> StageState:
    state = StageState()
    state.schedule = xp.make("zbv", 2, 4)  # rank 0 holds stages 0 and 3 (the loss)
    state.partitions = [nn.Linear(3, 3), nn.Linear(3, 2)]
    state._slot_of = {0: 0, 3: 1}
    state.loss_fn = nn.functional.mse_loss
    state.device = None
    state._devices = {}
    state._no_sync = no_sync
    # with no_sync, each stage's synchronised microbatch: its last backward's (data_parallel)
    state._synced = {} if no_sync is None else {0: 3, 3: 3}
    state.checkpoint = "except_last"
    state.scale_grads = True
    state._losses = {}
    state._leaves = {}  # the step's (set by _start_grads)
    return state


def test_module_and_device_per_stage() -> None:
    state = _state()
    assert state._module(3) is state.partitions[1]
    assert state._device(0) == torch.device("cpu") and state._devices == {0: torch.device("cpu")}
    state.device = torch.device("meta")  # a runtime given a device uses it for every stage
    assert state._device(3) == torch.device("meta")


def test_the_last_stage_returns_its_loss_as_it_is() -> None:
    """Its backward runs from the loss itself where m is not a power of two: the
    gradients are divided by m after the stage's last backward, as torch's schedules
    divide them (pipeline_scale). Where it is, the loss is divided, exactly and for free."""
    state = _state()
    m = state.schedule.num_microbatches
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    loss = nn.functional.mse_loss(state.partitions[1](x), y)
    want = loss / m if m & (m - 1) == 0 else loss
    assert torch.equal(state._run_forward(3, 0, x, y), want)
    assert torch.equal(state._losses[0], loss.detach())  # for step(losses=), undivided
    assert torch.equal(state._run_forward(0, 0, x, None), state.partitions[0](x))
    state.scale_grads = False  # a summed loss: the same
    assert torch.equal(state._run_forward(3, 1, x, y), loss)


def test_no_sync_wraps_all_but_the_last_microbatch_and_checkpointing_follows_it() -> None:
    entered: list[int] = []

    @contextlib.contextmanager
    def no_sync(slot: int) -> Iterator[None]:
        entered.append(slot)
        yield

    state = _state(no_sync)
    for mb in range(4):
        with state._sync_context(3, mb):
            pass
    assert entered == [1, 1, 1]  # the last microbatch's forward synchronises
    # With data parallelism the last microbatch is recomputed too (its forward is redone
    # right before its backward); without, "except_last" keeps it.
    assert [state._checkpointed(3, mb) for mb in range(4)] == [True] * 4
    assert [_state()._checkpointed(3, mb) for mb in range(4)] == [True, True, True, False]
    # A stage whose last backward is another microbatch's (looped BFS: the first's)
    # synchronises that one, and it is the one redone; the last keeps "except_last"'s.
    state._synced = {3: 0}
    synced = []
    for mb in range(4):
        before = len(entered)
        with state._sync_context(3, mb):
            pass
        if len(entered) == before:
            synced.append(mb)
    assert synced == [0]
    assert [state._checkpointed(3, mb) for mb in range(4)] == [True, True, True, False]
