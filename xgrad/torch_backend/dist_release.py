"""What PyTorch's engine does around a backward pass that xgrad's node engine must do itself.

xgrad's node engine calls each torch node from Python (:mod:`.dist_graph`), outside
torch's engine, so two things torch's engine does per graph task did not happen:

- **Saved tensors are released** after a pass without ``retain_graph``: a node keeps
  what its forward saved (an activation, a weight) until the node itself goes, and a
  loop that keeps its losses (``losses.append(loss)``) kept every pass's activations
  with them (hundreds of MB over ten steps where PyTorch keeps a few). At the exit of the
  context of such a pass, the saved tensors of each node it ran are replaced by nothing,
  through the saved tensor's own hooks (``SavedTensor.register_hooks``, whose pack drops
  the data); reading one afterwards raises PyTorch's words for a second backward through
  a freed graph. At the exit, not at the pass's end, as torch's engine frees them: the
  pass's last hops are a rank's critical path, and there a few microseconds a node
  showed as 3% of the bench's backward; by the exit the step's gradients are in hand.
- **A non-reentrant checkpoint recomputes once per pass**: its saved tensors are
  recomputed on first use in each graph task, and outside torch's engine every use
  was a graph task of its own, so the region ran once per saved tensor (37 times for a
  region of ten nodes; BatchNorm's running statistics and any other effect of the forward
  repeated). The node engine's pass runs in one ``torch.utils.checkpoint.GraphExecGroup``,
  PyTorch's way to make several backward calls one task for checkpointing. Not the waves
  in torch's engine: one wave resumes where another stopped, which the group refuses
  (the region runs three times there, not twice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["one_recompute", "release_saved"]

_SAVED_TENSOR: Any = torch._C._autograd.SavedTensor
#: per node type, its attributes that hold saved tensors (``_raw_saved_*``)
_SAVED: dict[type, tuple[str, ...]] = {}


def _freed(_: Any) -> None:
    raise RuntimeError(
        "Trying to backward through the graph a second time (or directly access saved "
        "tensors after they have already been freed): xgrad's distributed backward freed "
        "them as its context closed. Specify retain_graph=True if you need to backward "
        "through the graph a second time or to access saved tensors after calling backward."
    )


def _drop(_: torch.Tensor) -> None:
    return None


def _saved_of(node: Any) -> tuple[str, ...]:
    kind = type(node)
    names = _SAVED.get(kind)
    if names is None:
        names = _SAVED[kind] = tuple(a for a in dir(kind) if a.startswith("_raw_saved_"))
    return names


def release_saved(nodes: Iterable[Any]) -> None:
    """Free what ``nodes`` (torch ``grad_fn`` nodes a finished pass ran) saved for their
    backward, as torch's engine does after a pass without ``retain_graph``. A saved
    tensor that already has hooks (a checkpoint's, a ``saved_tensors_hooks`` context's) or
    was freed is left as it is."""
    for node in nodes:
        for name in _saved_of(node):
            try:
                value = getattr(node, name)
            except RuntimeError:  # already freed (by torch, or an earlier pass)
                continue
            for saved in value if isinstance(value, (tuple, list)) else (value,):
                # ``data`` is the tensor, None (nothing saved) or what hooks packed, and
                # reading it unpacks nothing; torch raises (slowly) on the other two.
                if type(saved) is _SAVED_TENSOR and isinstance(saved.data, torch.Tensor):
                    with contextlib.suppress(RuntimeError):  # its own hooks packed a tensor
                        saved.register_hooks(_drop, _freed)


@contextlib.contextmanager
def one_recompute() -> Iterator[None]:
    """The pass as one graph task for non-reentrant checkpoints (a no-op in a torch
    without ``GraphExecGroup``, or inside one the caller opened)."""
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    if group is None or group._get_current_group() is not None:
        yield
        return
    with group():
        yield
