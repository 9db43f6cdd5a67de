"""JAX backend: data-parallel gradients under shard_map, jit and pmap, PowerSGD, jaxpr graphs.

Importing this package does not import JAX; the names below are loaded on first use, so
``xgrad backends`` can ask :func:`available` cheaply.

Several hosts (documented, exercised here on one host only): start every process with
``jax.distributed.initialize(coordinator_address, num_processes, process_id)`` (no
arguments on managed clusters) before anything else touches JAX. ``jax.devices()`` then
lists the devices of every host, and ``data_parallel_value_and_grad(...,
world_size=jax.device_count())`` reduces over all of them with the same per-bucket code:
each process calls the step with the same global batch (``device_put`` keeps the shards
of its own devices) or, with ``local_batch=True``, with only its own rows (assembled by
``jax.make_array_from_process_local_data``). Use ``shard_map`` or ``jit`` across hosts:
pmap maps over one process's devices. Tested with 2 and 4 local CPU processes over gloo.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from xgrad.backend import lazy_attributes
from xgrad.jax_backend.runner import runners as runners

if TYPE_CHECKING:
    from xgrad.jax_backend.data_parallel import MODES as MODES
    from xgrad.jax_backend.data_parallel import DataParallelStep as DataParallelStep
    from xgrad.jax_backend.data_parallel import (
        data_parallel_value_and_grad as data_parallel_value_and_grad,
    )
    from xgrad.jax_backend.graph import JaxprGraph as JaxprGraph
    from xgrad.jax_backend.graph import backward_graph as backward_graph
    from xgrad.jax_backend.graph import find_unused_parameters as find_unused_parameters
    from xgrad.jax_backend.powersgd import PowerSGDCarry as PowerSGDCarry
    from xgrad.jax_backend.reduce import HOOKS as HOOKS
    from xgrad.jax_backend.reduce import leaf_names as leaf_names
    from xgrad.jax_backend.reduce import plan_for as plan_for
    from xgrad.jax_backend.reduce import plan_order as plan_order
    from xgrad.jax_backend.reduce import reduce_gradients as reduce_gradients
    from xgrad.powersgd import PowerSGD as PowerSGD

name = "jax"

#: ``xgrad bench`` targets -> their modules (see ``xgrad.backend.Backend``).
BENCHES: dict[str, str] = {"jax": "xgrad.jax_backend.bench"}

#: public name -> module that defines it (imported on first attribute access).
_EXPORTS: dict[str, str] = {
    "MODES": "xgrad.jax_backend.data_parallel",
    "DataParallelStep": "xgrad.jax_backend.data_parallel",
    "data_parallel_value_and_grad": "xgrad.jax_backend.data_parallel",
    "HOOKS": "xgrad.jax_backend.reduce",
    "leaf_names": "xgrad.jax_backend.reduce",
    "plan_for": "xgrad.jax_backend.reduce",
    "plan_order": "xgrad.jax_backend.reduce",
    "reduce_gradients": "xgrad.jax_backend.reduce",
    "JaxprGraph": "xgrad.jax_backend.graph",
    "backward_graph": "xgrad.jax_backend.graph",
    "find_unused_parameters": "xgrad.jax_backend.graph",
    "PowerSGD": "xgrad.powersgd",
    "PowerSGDCarry": "xgrad.jax_backend.powersgd",
    # The compression experiment's JAX run (xgrad.experiments calls it through the registry).
    "compression_runs": "xgrad.jax_backend.paper_compression",
}

__all__ = [
    "BENCHES",
    "array_ops",
    "available",
    "name",
    "run_ranks",
    "runners",
    "truth",
    *sorted(_EXPORTS),
]


def run_ranks(fn: Any, world_size: int, *, timeout: float = 60.0) -> list[Any]:
    """``fn(comm)`` on ``world_size`` ranks, each on a JAX CPU device; allreduce is a psum.

    (The data-parallel runners reduce inside a traced step instead; see
    :mod:`xgrad.jax_backend.comm`.)
    """
    from xgrad.jax_backend.comm import run_ranks as on_devices

    return on_devices(fn, world_size, timeout=timeout)


def array_ops() -> None:
    """None: JAX arrays are immutable, and the reducer's operations write in place."""
    return None


def truth() -> None:
    """None: the float64 truth comes from another backend."""
    return None


def __dir__() -> list[str]:
    """The public names, loaded or not, so tab completion and ``dir()`` show them."""
    return sorted({*__all__, *(n for n in globals() if n.startswith("__"))})


def available() -> bool:
    """Whether a JAX with ``jax.shard_map`` and ``lax.pcast`` (0.10 is tested) imports here."""
    if importlib.util.find_spec("jax") is None:
        return False
    try:
        import jax
    except ImportError:
        return False
    return hasattr(jax, "shard_map") and hasattr(jax.lax, "pcast")


__getattr__ = lazy_attributes(__name__, _EXPORTS)
