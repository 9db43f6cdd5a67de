"""One order, the same on every data-parallel replica, for the tensors a loss reads of its own.

``pipeline_loss_params`` finds them in the order the step's microbatches reach them, which
depends on the data: a loss that picks a head by its target (one head per task) reaches
head a then head b on one replica and b then a on another. ``dp_group`` averages them as
one flat tensor, so that order pairs a's gradient with b's where their shapes match (every
replica then gets a mix of both, and the replicas drift apart), and refuses replicas that
read the same tensors where they do not. No name says which tensor is which, so they are
ordered by where the loss function (or the stage's module) holds them: the objects it
reaches as Python objects (its closure, defaults and the globals its code names, a
``functools.partial``'s arguments, a bound method's instance, a module's attributes and
the globals its class's methods name, containers), walked in one order that the same
code builds alike on every replica. A tensor the loss reaches only
through its graph, not that walk, comes after, by dtype and shape; two of those alike
cannot be told apart (:func:`in_order` says so, and the caller refuses them on every
replica rather than guess).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["held", "in_order"]

#: objects the walk looks at, at most (a loss closing over a data set or a whole model
#: stays bounded; the same bound on every replica keeps the order the same)
_LIMIT = 20_000

#: what every module holds for torch's own use (hooks, flags): nothing a loss reads
_MODULE_INTERNALS = frozenset(vars(nn.Module()))

#: (known position or -1, dtype, shape): what a tensor is known by across the replicas
Key = tuple[int, str, tuple[int, ...]]


def held(loss_fn: Any, wanted: Collection[int] = ()) -> dict[int, int]:
    """``id`` -> position of every tensor that requires grad ``loss_fn`` holds as a Python
    object, in the order of a depth-first walk of what it refers to (not modules or
    classes); with ``wanted`` (ids), only until each of those has its position (the same
    as in the whole walk: a bound method of a large model costs a millisecond whole)."""
    order: dict[int, int] = {}
    seen: set[int] = set()
    todo: list[Any] = [loss_fn]
    missing = set(wanted)
    while todo and len(seen) < _LIMIT and (missing or not wanted):
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad:  # (data a replica holds more or less of: not counted)
                order.setdefault(id(obj), len(order))
                missing.discard(id(obj))
            continue
        todo += reversed(_refers_to(obj))  # (the first one walked first)
    return order


def _refers_to(obj: Any) -> list[Any]:
    if isinstance(obj, (types.ModuleType, type, str, bytes, int, float, complex, bool)):
        return []
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, types.FunctionType):
        cells = []
        for cell in obj.__closure__ or ():
            with contextlib.suppress(ValueError):  # a cell not yet filled
                cells.append(cell.cell_contents)
        names = [obj.__globals__[n] for n in _names(obj.__code__) if n in obj.__globals__]
        return [*cells, *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values(), *names]
    if isinstance(obj, nn.Module):  # its parameters, buffers, modules, the rest, its code
        kept = [v for k, v in vars(obj).items() if k not in _MODULE_INTERNALS]
        return [
            *obj._parameters.values(),
            *obj._buffers.values(),
            *obj._modules.values(),
            *kept,
            *_methods(type(obj)),
        ]
    if isinstance(obj, (list, tuple)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    try:
        return list(vars(obj).values())
    except TypeError:  # no ``__dict__``
        return []


def _methods(cls: type) -> list[Any]:
    """The functions a module's class and its bases define, torch's own left out: a
    stage's ``forward`` (and the helpers it calls) names the globals it reads there, a
    module-level ``nn.Parameter`` that no attribute holds. In the classes' order and
    each one's definition order: the same on every replica."""
    found: list[Any] = []
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "torch" or klass is object:
            continue
        for value in vars(klass).values():
            if isinstance(value, staticmethod | classmethod):
                value = value.__func__
            if isinstance(value, types.FunctionType):
                found.append(value)
    return found


def _names(code: types.CodeType) -> list[str]:
    """The global (and attribute) names ``code`` and the functions nested in it read."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _names(const)
    return names


def in_order(
    found: Sequence[torch.Tensor], loss_fn: Any
) -> tuple[list[torch.Tensor], list[Key], bool]:
    """``found`` in the replicas' common order, what each is known by there, and whether
    two of them cannot be told apart (neither held by ``loss_fn``, the same dtype and
    shape)."""
    position = held(loss_fn, {id(t) for t in found}) if len(found) > 1 else {}
    keys = [(position.get(id(t), -1), str(t.dtype), tuple(t.shape)) for t in found]
    ranked = sorted(range(len(found)), key=lambda i: (keys[i][0] < 0, keys[i]))
    unknown = [keys[i][1:] for i in ranked if keys[i][0] < 0]
    return [found[i] for i in ranked], [keys[i] for i in ranked], len(set(unknown)) < len(unknown)
