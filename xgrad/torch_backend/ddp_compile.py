"""How ``torch.compile`` sees xgrad's DDP: the module is traced, the reducer never is.

PyTorch's DDP lives in a file dynamo skips, so dynamo compiles only the wrapped module
and runs DDP's Python around it eagerly. xgrad's wrapper is ordinary user code, so
dynamo would trace into the bucket rebuild (``broadcast_object_list``) and the reducer
and fail. Here:

* ``forward`` is skipped by dynamo as a frame (``disable(recursive=False)``), so the
  frames it calls are still compiled: the wrapped module is;
* the reducer-side steps (``_pre_forward``: rebuild broadcast, buffer sync, casts;
  ``_post_forward``: unused-parameter search, ``prepare_for_backward``) are
  ``torch._dynamo.disable``-d entirely, so no collective is ever traced;
* the module runs inside ``_inside_ddp_forward()`` (inherited from PyTorch's class), which
  tells dynamo a DDP module is active. With ``torch._dynamo.config.optimize_ddp`` on
  (its default, ``"ddp_optimizer"``), dynamo's ``DDPOptimizer`` then splits the
  compiled graph into pieces of about ``bucket_bytes_cap`` parameter bytes, so the
  backward runs as several compiled pieces with the parameters' ``AccumulateGrad``
  between them. xgrad's post-accumulate hooks fire there, eagerly, exactly as without
  compile: the reducer fills and launches buckets while later pieces still compute
  (overlap). With ``optimize_ddp=False`` there is one graph, and every hook fires after
  the whole compiled backward: the same gradients, no overlap.

Compiled autograd (``torch._dynamo.config.compiled_autograd``, ``compiled_autograd._enable``)
traces the backward's hooks themselves: PyTorch's C++ reducer refuses it, and its Python
reducer (``optimize_ddp="python_reducer"``) runs under it. xgrad's reducer queues the end of
its pass on the autograd engine and times it, which compiled autograd cannot trace (it
failed in dynamo's internals); it refuses it at the pass's first gradient hook, saying so.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

#: what a backward under compiled autograd raises (PyTorch's C++ reducer's wording, adapted).
NO_COMPILED_AUTOGRAD = (
    "Compiled autograd is not compatible with xgrad's DistributedDataParallel: its reducer "
    "runs as eager Python hooks that compiled autograd would trace; run the backward pass "
    "without compiled autograd (torch._dynamo.config.compiled_autograd = False, no "
    "compiled_autograd._enable), or use torch.nn.parallel.DistributedDataParallel with "
    'torch._dynamo.config.optimize_ddp = "python_reducer"'
)


def refuse_compiled_autograd() -> None:
    """Raise :data:`NO_COMPILED_AUTOGRAD` in a backward pass compiled autograd captures.

    Read from ``sys.modules``: a process that never imported dynamo cannot have it on, and
    importing it here would cost every DDP process about a second.
    """
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    if module is None:
        return
    if module.compiled_autograd_enabled or module.in_compiled_autograd_region:
        raise RuntimeError(NO_COMPILED_AUTOGRAD)
    if torch.compiler.is_compiling():  # dynamo traces the hook: compiled autograd's graph
        raise RuntimeError(NO_COMPILED_AUTOGRAD)


# PyTorch's own lazy form of ``torch._dynamo.disable``, as its DDP uses it: dynamo is
# imported at the first call, not when this module is. Importing dynamo takes about 1.2 s,
# which every process importing xgrad's torch backend paid (a pipeline or a distributed
# autograd that never runs a DDP forward pass, the `xgrad` command, each test rank).
_disable: Callable[..., Any] = getattr(torch, "_disable_dynamo", None) or (
    lambda fn, recursive=True: torch._dynamo.disable(fn, recursive=recursive)
)


def frame_skipped(fn: F) -> F:
    """Dynamo skips ``fn``'s own frame but still compiles the frames it calls."""
    return _disable(fn, recursive=False)  # type: ignore[no-any-return]


def outside_dynamo(fn: F) -> F:
    """Run ``fn`` and everything it calls eagerly, never traced (a dynamo graph break)."""
    return _disable(fn, recursive=True)  # type: ignore[no-any-return]


@frame_skipped
def traced_module_call(ddp: Any, *inputs: Any, **kwargs: Any) -> Any:
    """The wrapped module's forward, inside DDP's "active module" context for dynamo."""
    with ddp._inside_ddp_forward():
        return ddp.module(*inputs, **kwargs)
