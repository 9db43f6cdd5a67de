"""PyTorch backend: c10d process groups, autograd hooks, a DDP drop-in, a local launcher.

Importing this package does not import torch; the names below are loaded on first use,
so ``xgrad backends`` can ask :func:`available` cheaply.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from xgrad.backend import lazy_attributes
from xgrad.torch_backend.runner import array_ops as array_ops
from xgrad.torch_backend.runner import run_ranks as run_ranks
from xgrad.torch_backend.runner import runners as runners
from xgrad.torch_backend.runner import truth as truth

# Imported now, not lazily: ``spawn`` is also the name of its submodule, and importing that
# submodule later (anyone's ``from xgrad.torch_backend.spawn import ...``) would rebind the
# package attribute to the module. spawn.py imports torch only when it runs.
from xgrad.torch_backend.spawn import SpawnError as SpawnError
from xgrad.torch_backend.spawn import spawn as spawn

if TYPE_CHECKING:
    from xgrad.torch_backend import dist_autograd as dist_autograd
    from xgrad.torch_backend.comm import TorchComm as TorchComm
    from xgrad.torch_backend.ddp import DistributedDataParallel as DistributedDataParallel
    from xgrad.torch_backend.ddp import IterationTimes as IterationTimes
    from xgrad.torch_backend.dist_autograd import DistBackwardError as DistBackwardError
    from xgrad.torch_backend.ops import TorchArrayOps as TorchArrayOps
    from xgrad.torch_backend.pipeline import PipelineRuntime as PipelineRuntime

name = "torch"

#: ``xgrad bench`` targets -> their modules (see ``xgrad.backend.Backend``).
BENCHES: dict[str, str] = {
    "ddp": "xgrad.torch_backend.bench",
    "dist-autograd": "xgrad.torch_backend.dist_autograd_bench",
    "faults": "xgrad.torch_backend.faults_bench",
    "pipeline": "xgrad.torch_backend.pipeline_bench",
}

#: public name -> module that defines it (imported on first attribute access).
_EXPORTS: dict[str, str] = {
    "DistributedDataParallel": "xgrad.torch_backend.ddp",
    "DistBackwardError": "xgrad.torch_backend.dist_autograd",
    "IterationTimes": "xgrad.torch_backend.ddp",
    "TorchComm": "xgrad.torch_backend.comm",
    "TorchArrayOps": "xgrad.torch_backend.ops",
    "PipelineRuntime": "xgrad.torch_backend.pipeline",
    # PowerSGD's fresh Q as torch.randn draws them (xgrad.powersgd.Sampler): found through
    # the registry (xgrad.backend.find_sampler) so others replay torch's draws.
    "powersgd_sampler": "xgrad.torch_backend.powersgd",
    # The experiments' per-rank workers (xgrad.experiments spawns them through the registry).
    "allreduce_worker": "xgrad.torch_backend.paper_workers",
    "bucket_worker": "xgrad.torch_backend.paper_workers",
    "compression_worker": "xgrad.torch_backend.paper_compression",
    "no_sync_worker": "xgrad.torch_backend.paper_workers",
    "overlap_worker": "xgrad.torch_backend.paper_workers",
    "pipeline_worker": "xgrad.torch_backend.paper_pipeline",
}

#: submodules that are public names themselves (``from xgrad.torch_backend import dist_autograd``).
_SUBMODULES = ("dist_autograd",)

__all__ = [
    "BENCHES",
    "SpawnError",
    "array_ops",
    "available",
    "name",
    "run_ranks",
    "runners",
    "spawn",
    "truth",
    *sorted(_EXPORTS),
    *_SUBMODULES,
]


def available() -> bool:
    """Whether torch with ``torch.distributed`` can be used in this environment."""
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_available())


_lazy = lazy_attributes(__name__, _EXPORTS)


def __getattr__(attr: str) -> object:
    if attr in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{attr}")
    return _lazy(attr)
