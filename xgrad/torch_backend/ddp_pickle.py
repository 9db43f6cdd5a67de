"""Pickling and ``copy.deepcopy`` of the DDP, where PyTorch's DDP allows them.

PyTorch's DDP pickles its module and settings (only over the default process group) and,
when unpickled or deep-copied, builds a fresh reducer for the copied module, with no
collective of construction (no parameter check, no broadcast) and no communication hook.
Code that copies a wrapped model (EMA weights, checkpoints of the whole wrapper, test
harnesses) relies on it; torch's own ``__getstate__`` cannot serve here (it deletes
attributes this DDP does not have). The copy is constructed again from the arguments
the original was given, with ``init_sync=False`` and the original's ``static_graph``;
as for any construction, every rank of the group makes its copy (the copy takes its own
private group and failure channel).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist

__all__ = ["PicklableDDP"]

#: PyTorch's error for a DDP over another group than the default one.
_NOT_DEFAULT = (
    "DDP Pickling/Unpickling are only supported when using DDP with the default process "
    "group. That is, when you have called init_process_group and have not passed "
    "process_group argument to DDP constructor"
)


class PicklableDDP:
    """Mixed into the DDP: remembers its constructor arguments, rebuilds a copy from them."""

    module: Any
    process_group: Any
    device_mesh: Any
    static_graph: bool
    training: bool

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super().__new__(cls)
        # Before nn.Module.__init__ (whose __setattr__ is not ready yet): straight in __dict__.
        obj.__dict__["_init_arguments"] = (args, kwargs)
        return obj

    def __getstate__(self) -> dict[str, Any]:
        try:
            default = dist.distributed_c10d._get_default_group()
        except (RuntimeError, ValueError):
            default = None
        if self.process_group is not default or self.device_mesh is not None:
            raise RuntimeError(_NOT_DEFAULT)
        args, kwargs = self.__dict__["_init_arguments"]
        bound = inspect.signature(type(self).__init__).bind(self, *args, **kwargs)
        arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
        arguments.pop("process_group", None)
        arguments.pop("device_mesh", None)
        arguments.update(module=self.module, init_sync=False, static_graph=self.static_graph)
        return {"arguments": arguments, "training": self.training}

    def __setstate__(self, state: dict[str, Any]) -> None:
        arguments = state["arguments"]
        self.__dict__["_init_arguments"] = ((), arguments)
        type(self).__init__(self, **arguments)  # type: ignore[misc]
        self.train(state["training"])  # type: ignore[attr-defined]
