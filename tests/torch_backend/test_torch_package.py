"""The torch backend package: lazy, available here, and DDP refuses to run without a group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import xgrad.torch_backend as tb


def test_package_is_lazy_and_available() -> None:
    assert tb.available()
    assert tb.DistributedDataParallel.__name__ == "DistributedDataParallel"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = tb.nope


def test_ddp_needs_an_initialised_group() -> None:
    # The same error as PyTorch's own DDP gives without a process group.
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        torch.nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        tb.DistributedDataParallel(nn.Linear(2, 2))
