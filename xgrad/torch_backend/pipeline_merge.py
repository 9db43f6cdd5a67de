"""The last stage's outputs of a step's microbatches merged into one batch, as torch's
``merge_chunks`` merges them: by default along dim 0, else as the runtime's
``output_merge_spec`` says (:mod:`~xgrad.torch_backend.pipeline_specs` reads the specs).
Merged after the step, on the last stage's rank alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from xgrad.torch_backend.pipeline_specs import (
    at_rank,
    leaf_specs,
    mismatch,
    spec_text,
    torch_specs,
)

__all__ = ["merge_by_spec", "merge_outputs"]


def merge_outputs(outputs: list[Any], spec: Any = None, rank: int | None = None) -> Any:
    """The microbatches' outputs as one batch, as torch's ``merge_chunks`` gives them:
    tensor leaves concatenated along dim 0 (0-dim ones stacked), other leaves as the list
    of each microbatch's; with ``spec`` (``output_merge_spec``), as it says
    (:func:`merge_by_spec`).

    Raises:
        ValueError: two microbatches' outputs of different structures (named), or outputs
            ``spec`` cannot merge.
    """
    flat = [pytree.tree_flatten(out) for out in outputs]
    tree = flat[0][1]
    for mb, (_, other) in enumerate(flat):
        if other != tree:
            raise ValueError(
                f"the last stage's output of microbatch {mb} has another structure than "
                f"microbatch 0's ({other} against {tree}): they cannot be merged"
            )
    if spec is not None:
        return merge_by_spec(outputs, spec, rank)
    merged: list[Any] = []
    for column in zip(*(leaves for leaves, _ in flat), strict=True):
        if all(isinstance(t, torch.Tensor) for t in column):
            ts: list[torch.Tensor] = list(column)
            merged.append(torch.stack(ts) if ts[0].dim() == 0 else torch.cat(ts))
        else:
            merged.append(list(column))
    return pytree.tree_unflatten(merged, tree)


def merge_by_spec(outputs: list[Any], spec: Any, rank: int | None) -> Any:
    """The microbatches' outputs as one batch, as torch's ``merge_chunks`` merges them
    with ``output_merge_spec``: along a ``TensorChunkSpec``'s dim, by a ``_CustomReducer``
    (``sum_reducer``), or, for any other leaf spec, the one value every microbatch gave.

    A spec of another structure with as many leaves is paired leaf by leaf as torch pairs
    it, and the result takes the spec's structure, as torch's does
    (``(TensorChunkSpec(1),)`` for a tensor output gives a 1-tuple).

    Raises:
        ValueError: a spec that does not fit the outputs, a dim out of range, outputs that
            do not concatenate, or microbatches that give different values for a leaf
            merged as one (naming the leaf, the spec and the rank).
    """
    mb = torch_specs()
    first = outputs[0]
    found = leaf_specs(spec, first)
    if found is None:
        raise mismatch("output_merge_spec", spec, "the last stage's output", first, rank)
    specs, torchs = found
    paths, tree = pytree.tree_flatten_with_path(first)
    columns = list(zip(*(pytree.tree_leaves(out) for out in outputs), strict=True))
    merged = []
    for (path, _), s, column in zip(paths, specs, columns, strict=True):
        label = "the last stage's output" + pytree.keystr(path)
        if isinstance(s, mb.TensorChunkSpec):
            merged.append(_concatenated(list(column), s, label, rank))
        elif isinstance(s, mb._CustomReducer):
            value = s.init_value
            for leaf in column:
                value = s.reduce_fn(value, leaf)
            merged.append(value)
        else:
            merged.append(_the_same(list(column), s, label, rank))
    return pytree.tree_unflatten(merged, pytree.tree_structure(spec) if torchs else tree)


def _concatenated(column: list[Any], spec: Any, label: str, rank: int | None) -> Any:
    if not all(isinstance(t, torch.Tensor) for t in column):
        return column  # as by default: each microbatch's, as a list
    dim, ndim = spec.split_dim, column[0].dim()
    if ndim == 0 and dim in (0, -1):
        return torch.stack(column)  # as by default
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{at_rank(rank)}output_merge_spec gives {label} {spec}, and it has {ndim} dims "
            f"(shape {list(column[0].shape)}): split_dim must be in [{-ndim}, {ndim - 1}]"
        )
    try:
        return torch.cat(column, dim)
    except RuntimeError as exc:
        raise ValueError(
            f"{at_rank(rank)}{label} does not concatenate along dim {dim} (output_merge_spec "
            f"{spec}): {exc}"
        ) from exc


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def _the_same(column: list[Any], spec: Any, label: str, rank: int | None) -> Any:
    for k, leaf in enumerate(column[1:], 1):
        if not _same(column[0], leaf):
            raise ValueError(
                f"{at_rank(rank)}output_merge_spec gives {label} {spec_text(spec)}, one value "
                f"for the whole batch, and microbatch {k} gave another than microbatch 0 "
                "(TensorChunkSpec(dim) concatenates it)"
            )
    return column[0]
