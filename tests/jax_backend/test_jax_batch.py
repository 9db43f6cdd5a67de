"""in_axes, the checks on split arguments, and the device list of the data-parallel step."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from xgrad.jax_backend.batch import check_batch, devices_for, normalize_in_axes  # noqa: E402


def test_in_axes_forms() -> None:
    assert normalize_in_axes(0, 3) == (0, 0, 0)
    assert normalize_in_axes(None, 2) == (None, None)
    assert normalize_in_axes((0, None), 2) == (0, None)
    assert normalize_in_axes([None, 0, None], 2) == (0, None)  # pmap's, params first
    with pytest.raises(ValueError, match=r"in_axes=\(0,\) has 1 entries for 2"):
        normalize_in_axes((0,), 2)
    with pytest.raises(ValueError, match=r"in_axes\[1\]=-1: only 0"):
        normalize_in_axes((0, -1), 2)
    with pytest.raises(TypeError, match="in_axes='x'"):
        normalize_in_axes("x", 1)


def test_split_arguments_are_checked_leaf_by_leaf() -> None:
    batch = ({"a": np.zeros((4, 2)), "b": [np.zeros(4), np.zeros(3)]},)
    with pytest.raises(ValueError, match=r"batch argument 0\['b'\]\[1\] has leading dimension 3"):
        check_batch(batch, (0,), 2, "world_size=2")
    check_batch(({"a": np.zeros((4, 2))}, np.float32(1)), (0, None), 2, "world_size=2")
    with pytest.raises(ValueError, match=r"batch argument 0 is a scalar"):
        check_batch((np.float32(1),), (0,), 2, "world_size=2")
    # Uneven (shard_map and pmap split it as tensor_split), but never an empty shard.
    check_batch(batch, (0,), 2, "world_size=2", uneven=True)
    with pytest.raises(
        ValueError, match=r"0\['b'\]\[1\] has 3 rows, fewer than 4 \(world_size=4\)"
    ):
        check_batch(batch, (0,), 4, "world_size=4", uneven=True)


def test_devices_for() -> None:
    assert len(devices_for(2, None)) == 2
    with pytest.raises(ValueError, match="world_size=0 must be a positive integer"):
        devices_for(0, None)
    with pytest.raises(ValueError, match="world_size=3 needs 3 JAX devices but 2"):
        devices_for(3, jax.devices()[:2])
