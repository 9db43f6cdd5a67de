"""The context keeps a leaf's first gradient without a copy only when nothing else can see it.

``Accumulate.private``: one gradient that reached two leaves, a gradient a leaf's hook
kept, a view, or one referenced elsewhere is copied, so changing one in place changes
nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

from xgrad.torch_backend.dist_accumulate import Accumulate


def _first(acc: Accumulate, *grads: torch.Tensor) -> None:
    for g in grads:
        acc(None, g)


def _private(acc: Accumulate, grads: dict[int, torch.Tensor], i: int, leaf: Any) -> Any:
    # As dist_accumulate.keep calls it: the gradient popped, held by this frame alone.
    grad = grads.pop(i)
    return acc.private(grad, leaf)


def test_a_first_gradient_is_kept_without_a_copy_only_when_nothing_else_sees_it() -> None:
    leaf = torch.zeros(3, requires_grad=True)
    acc = Accumulate()
    grads = {0: torch.ones(3)}
    ident = id(grads[0])
    _first(acc, grads[0])
    assert id(_private(acc, grads, 0, leaf)) == ident  # sole owner: kept
    # A sum made by the pass is its own.
    total = torch.ones(3) + 1
    assert Accumulate().private(total, leaf) is total

    shared = torch.ones(3)
    acc = Accumulate()
    _first(acc, shared, shared)  # one tensor reached two leaves
    assert Accumulate.private(acc, shared, leaf) is not shared

    cases = {}
    acc = Accumulate()
    base = torch.ones(6)
    cases["view"] = base[:3]
    cases["other holder"] = torch.ones(3)
    holder = [cases["other holder"]]
    cases["same storage"] = torch.ones(3)
    alias = cases["same storage"].detach()
    hooked = torch.zeros(3, requires_grad=True)
    hooked.register_hook(lambda g: g)
    cases["hooked leaf"] = torch.ones(3)
    cases["no leaf"] = torch.ones(3)
    names = list(cases)
    grads = dict(enumerate(cases.values()))
    ids = {i: id(g) for i, g in grads.items()}
    _first(acc, *grads.values())
    cases.clear()
    for i, name in enumerate(names):
        target = hooked if name == "hooked leaf" else None if name == "no leaf" else leaf
        out = _private(acc, grads, i, target)
        assert id(out) != ids[i], name
    assert holder and alias is not None and base is not None
