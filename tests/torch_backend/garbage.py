"""What a block leaves for the cyclic garbage collector, and which of it is xgrad's.

Shared by the tests that count garbage (``test_torch_cycles`` explains the judge: the
garbage split into connected pieces, a piece xgrad's when it holds a tensor or anything
from an ``xgrad`` module).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def is_xgrads(obj: Any) -> bool:
    """Whether ``obj`` is a tensor, or comes from an ``xgrad`` module (see module doc)."""
    import os
    import types

    import xgrad

    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, types.FrameType):
        package = os.path.dirname(xgrad.__file__) + os.sep
        return obj.f_code.co_filename.startswith(package)
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    if isinstance(obj, (types.FunctionType, type)):
        return str(getattr(obj, "__module__", "")).startswith("xgrad")
    return str(type(obj).__module__).startswith("xgrad")


def _name(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def describe(piece: list[Any]) -> str:
    """A piece of garbage in a line: its size, tensors, exceptions, xgrad's types and frames."""
    import os
    import types

    kinds: set[str] = set()
    frames, tensors = [], 0
    for obj in piece:
        if isinstance(obj, torch.Tensor):
            tensors += 1
        elif isinstance(obj, types.FrameType):
            code = obj.f_code
            where = f"{os.path.basename(code.co_filename)}:{obj.f_lineno}"
            frames.append(f"{code.co_name} ({where})")
        elif isinstance(obj, BaseException) or is_xgrads(obj):
            kinds.add(_name(obj))
    return (
        f"{len(piece)} objects, {tensors} tensors; "
        f"{', '.join(sorted(kinds)) or 'no xgrad objects'}; frames: {', '.join(frames) or 'none'}"
    )


def pieces(garbage: list[Any]) -> list[list[Any]]:
    """``garbage`` split into its connected pieces (references among it, either way)."""
    import gc

    index = {id(obj): i for i, obj in enumerate(garbage)}
    parent = list(range(len(garbage)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, obj in enumerate(garbage):
        for ref in gc.get_referents(obj):
            j = index.get(id(ref))
            if j is not None:
                parent[root(i)] = root(j)
    groups: dict[int, list[Any]] = {}
    for i, obj in enumerate(garbage):
        groups.setdefault(root(i), []).append(obj)
    return list(groups.values())


@contextlib.contextmanager
def xgrad_garbage(result: dict[str, Any]) -> Iterator[None]:
    """``result["garbage"]``: the pieces of xgrad's the block left for the garbage
    collector (collector off meanwhile, everything before the block out of its sight).
    What must end first (a thread that may still hold an object) is joined inside the
    block."""
    import gc

    gc.collect()
    gc.disable()
    gc.freeze()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield
        gc.collect()
        result["garbage"] = [describe(p) for p in pieces(gc.garbage) if any(map(is_xgrads, p))]
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
