"""Which parameters DDP reduces, in which order, and on which device.

PyTorch's DDP walks the module tree and keeps every parameter that requires a gradient,
is not in ``_ddp_params_and_buffers_to_ignore`` and was not seen before (shared
parameters once); that order is the index space of the plan and the reducer. The device
checks follow PyTorch's wording.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def produces_sparse_gradient(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters get sparse gradients (``sparse=True`` embeddings)."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return bool(module.sparse)
    return False


def reduced_parameters(
    module: nn.Module, ignore: set[str]
) -> tuple[list[str], list[nn.Parameter], list[bool]]:
    """DDP's parameter order: by module, requiring grad, not ignored, shared ones once.

    Returns:
        The names, the parameters, and per parameter whether its gradient is sparse.
    """
    names: list[str] = []
    params: list[nn.Parameter] = []
    sparse: list[bool] = []
    seen: set[int] = set()
    for module_name, sub in module.named_modules():
        for param_name, p in sub.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if not p.requires_grad or name in ignore or id(p) in seen:
                continue
            seen.add(id(p))
            names.append(name)
            params.append(p)
            sparse.append(produces_sparse_gradient(sub))
    return names, params, sparse


def resolve_devices(
    params: Sequence[nn.Parameter],
    device_ids: Sequence[int | torch.device] | None,
    output_device: int | torch.device | None,
) -> tuple[str, list[int] | None, int | None]:
    """The module's device type, ``device_ids`` and ``output_device`` as DDP accepts them.

    Raises:
        ValueError: parameters on several device types, several ``device_ids``, or
            ``device_ids``/``output_device`` given for a CPU module.
    """
    device_types = {p.device.type for p in params}
    if len(device_types) != 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, "
            f"but input module parameters locate in {device_types}."
        )
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(
            f"device_ids can only be None or contain a single element, got {device_ids!r}"
        )
    device_type = device_types.pop()
    if not device_ids or device_type == "cpu":
        # PyTorch's test is truthiness: output_device=0 passes with a CPU module.
        if device_ids or output_device:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work "
                f"with single-device GPU modules, but got device_ids {device_ids}, "
                f"output_device {output_device} and a {device_type} module."
            )
        return device_type, None, None
    ids = [device_index(d) for d in device_ids]
    return device_type, ids, ids[0] if output_device is None else device_index(output_device)


def device_index(device: int | torch.device) -> int:
    """``3``, ``torch.device("cuda", 3)`` and ``torch.device("cuda:3")`` all give 3."""
    if isinstance(device, torch.device):
        return 0 if device.index is None else device.index
    return int(device)
