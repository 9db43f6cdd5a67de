"""DDP constructor arguments that PyTorch 2.13 resolves before building anything.

The process group (``process_group`` or a 1-D ``device_mesh``) and the buffer flags
(``broadcast_buffers``, deprecated in 2.13, and its replacement ``forward_sync_buffers``)
follow PyTorch's rules and warnings, so a script moving between the two sees the same.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist


def resolve_group(process_group: Any, device_mesh: Any) -> tuple[Any, Any]:
    """The group to reduce over and the mesh it came from (``None`` without one).

    Raises:
        ValueError: no process group initialised (PyTorch's error and type, with a hint).
        RuntimeError: both given, or a mesh that is not 1-D (PyTorch's errors).
    """
    if not dist.is_initialized():
        raise ValueError(
            "Default process group has not been initialized, please make sure to call "
            "init_process_group (torchrun sets the environment for it) or use "
            "xgrad.torch_backend.spawn."
        )
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is None:
        if process_group is None:
            # PyTorch's DDP holds the default group itself (``join_process_group``).
            process_group = dist.distributed_c10d._get_default_group()
        return process_group, None
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
    return device_mesh.get_group(mesh_dim=0), device_mesh


def buffer_sync_flags(
    broadcast_buffers: bool | None, forward_sync_buffers: bool | None
) -> tuple[bool, bool]:
    """``(sync buffers before each forward pass, broadcast buffers at construction)``.

    ``forward_sync_buffers`` wins and leaves the construction-time sync on; the
    deprecated ``broadcast_buffers`` alone governs both, as before 2.13. ``None`` for
    both means ``True``.
    """
    if broadcast_buffers is not None:
        warnings.warn(
            "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
            "`broadcast_buffers` is deprecated and its value is ignored when "
            "`forward_sync_buffers` is provided."
            if forward_sync_buffers is not None
            else "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. "
            "IMPORTANT: unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still "
            "syncs buffers at init. If you rely on buffers NOT being synced at init (e.g. "
            "rank-local buffers), keep using `broadcast_buffers=False` until "
            "`init_sync_buffers` is available.",
            FutureWarning,
            stacklevel=3,
        )
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return effective, effective
