"""JAX's process group as an :class:`xgrad.backend.Comm`: ranks are threads, one device each.

An allreduce is one ``psum`` over the ranks' devices (``jax.pmap`` over a ``ranks`` axis):
every rank contributes its array, the last to arrive launches the collective, and rank ``r``
gets the sum that lives on its device. Matching collectives by number, bounded waits, and a
failure on one rank ending every rank's wait are the reference backend's in-process
rendezvous (:class:`xgrad.reference.World`), reused here; only the sum is JAX's. JAX arrays
are immutable, so ``wait()`` returns the sum instead of writing it into the buffer.

The data-parallel runners do not need this (they reduce inside a traced step); it gives the
conformance battery, and any code written against ``Comm``, JAX's collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xgrad.jax_backend.crosscheck import cpu_devices
from xgrad.reference.comm import CollectiveError, ReferenceComm, World, spawn

T = TypeVar("T")

__all__ = ["DeviceWorld", "JaxComm", "JaxWork", "run_ranks"]

DEFAULT_TIMEOUT_S = 60.0


class DeviceWorld(World):
    """``len(devices)`` ranks, rank ``r`` on ``devices[r]``; allreduce is a ``psum``."""

    def __init__(self, devices: Sequence[Any], *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(len(devices), timeout=timeout)
        self.devices = list(devices)

    def comm(self, rank: int) -> JaxComm:
        return JaxComm(self, rank)

    def _combine(self, seq: int, op: Any) -> tuple[Any, int]:
        if op.kind != "allreduce":
            return super()._combine(seq, op)
        first = op.contributions[0]
        for r, c in enumerate(op.contributions):
            if c.shape != first.shape or c.dtype != first.dtype:
                raise CollectiveError(
                    f"allreduce #{seq}: rank {r} gave shape {c.shape} dtype {c.dtype}, "
                    f"rank 0 gave shape {first.shape} dtype {first.dtype}"
                )
        wide = np.dtype(first.dtype) == np.float64
        with jax.enable_x64(wide):  # float64 stays float64 (JAX's default would round it)
            stacked = np.stack([np.asarray(c) for c in op.contributions])
            psum = jax.pmap(lambda v: lax.psum(v, "ranks"), axis_name="ranks", devices=self.devices)
            total = psum(stacked)
            per_rank = [total[r] for r in range(self.size)]
        return per_rank, int(np.asarray(first).nbytes)


class JaxWork:
    """One rank's in-flight allreduce; :meth:`wait` returns the sum on that rank's device."""

    def __init__(self, world: DeviceWorld, rank: int, seq: int) -> None:
        self._world = world
        self._rank = rank
        self._seq = seq
        self._value: Any = None

    def wait(self) -> Any:
        if self._value is None:
            per_rank, _ = self._world._result(self._rank, self._seq, "allreduce")
            self._value = per_rank[self._rank]
        return self._value


class JaxComm(ReferenceComm):
    """One rank of a :class:`DeviceWorld`: the :class:`~xgrad.backend.Comm` protocol."""

    def allreduce(self, buffer: Any) -> JaxWork:  # type: ignore[override]
        """Start a SUM of ``buffer`` (a JAX or NumPy array) over the ranks' devices."""
        if not hasattr(buffer, "shape") or not hasattr(buffer, "dtype"):
            raise TypeError(
                f"rank {self.rank}: allreduce takes an array, got {type(buffer).__name__}"
            )
        world = self.world
        assert isinstance(world, DeviceWorld)
        seq = world._join(self.rank, "allreduce", np.array(buffer, copy=True))
        return JaxWork(world, self.rank, seq)


def run_ranks(
    fn: Callable[[JaxComm], T], world_size: int, *, timeout: float = DEFAULT_TIMEOUT_S
) -> list[T]:
    """``fn(comm)`` on ``world_size`` ranks (threads), rank ``r`` on JAX CPU device ``r``."""
    devices = cpu_devices(world_size)
    if len(devices) < world_size:
        raise ValueError(
            f"world_size={world_size}: JAX has {len(devices)} CPU devices here (set "
            "XLA_FLAGS=--xla_force_host_platform_device_count before JAX starts)"
        )
    world = DeviceWorld(devices[:world_size], timeout=timeout)
    return spawn(fn, world_size, world=world)  # type: ignore[arg-type]


def to_numpy(x: Any) -> np.ndarray:
    """A JAX array's value as NumPy (blocking until it is computed)."""
    return np.asarray(jnp.asarray(x))
