"""torch's chunk specs for the pipeline runtime: how a step splits its inputs and the
model's keywords into microbatches (merging the outputs: :mod:`.pipeline_merge`).

torch 2.13's schedules take ``args_chunk_spec`` (a tuple, a spec per positional argument),
``kwargs_chunk_spec`` (a dict, a spec per keyword) and ``output_merge_spec``, whose leaves
are ``TensorChunkSpec(split_dim)`` (split, or concatenate, along that dim; ``1`` for
sequence-first data) and ``_Replicate`` (given whole to every microbatch), and for outputs
``_CustomReducer`` (``sum_reducer``) too (``torch.distributed.pipelining.microbatch``).
Here, as there, a spec is a pytree of the value's structure; it may also stop early, a leaf
spec standing for every leaf under it (``_Replicate()`` for a whole dict, where torch needs
a spec per leaf). Better than torch's: ``kwargs_chunk_spec`` is matched with the keywords
by name (torch pairs them by position: ``{"pos": T(0), "mask": T(1)}`` for
``step(mask=, pos=)`` splits the mask along dim 0, and a misspelt name passes unseen); a
bad dim, or fewer rows than microbatches, is a ``ValueError`` naming the spec, the value
and the rank (torch: an ``IndexError`` or an ``AssertionError``). A size m does not divide
splits unevenly, as torch's (:mod:`~xgrad.torch_backend.pipeline_rows`).

torch's module imports ``DTensor`` and flex attention (a second and a half), so it is
imported only when a spec is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from xgrad.torch_backend.pipeline_rows import Rows, split_rows

__all__ = [
    "ChunkSpecs",
    "at_rank",
    "chunk_specs",
    "leaf_specs",
    "mismatch",
    "spec_text",
    "split_by_spec",
    "split_inputs",
    "split_keywords_by_spec",
    "torch_specs",
]


def torch_specs() -> Any:
    """torch's ``microbatch`` module (imported when first needed)."""
    from torch.distributed.pipelining import microbatch

    return microbatch


@dataclass(frozen=True)
class ChunkSpecs:
    """A runtime's specs, as given (``None``: xgrad's default, along dim 0)."""

    args: tuple[Any, ...] | None = None
    kwargs: dict[str, Any] | None = None
    outputs: Any = None

    @property
    def batch_dim(self) -> int | None:
        """The dim of a tensor output that holds the batch the targets hold along dim 0,
        where known: the ``output_merge_spec``'s (a ``TensorChunkSpec``, or torch's
        ``(TensorChunkSpec,)``), else 0 unless the inputs or keywords are spec'd (their
        batch may lie along another dim, a sequence-first one's along 1)."""
        spec = self.outputs
        if isinstance(spec, tuple | list) and len(spec) == 1:
            spec = spec[0]
        if spec is None:
            return 0 if self.args is None and self.kwargs is None else None
        return spec.split_dim if isinstance(spec, torch_specs().TensorChunkSpec) else None


def _is_replicate(spec: Any) -> bool:
    # torch's own test: "spec is _Replicate or isinstance(spec, _Replicate)".
    replicate = torch_specs()._Replicate
    return spec is replicate or isinstance(spec, replicate)


def spec_text(spec: Any) -> str:
    """A spec as its user wrote it (torch's ``_Replicate`` has no repr of its own)."""
    if isinstance(spec, dict):
        return "{" + ", ".join(f"{k!r}: {spec_text(v)}" for k, v in spec.items()) + "}"
    if isinstance(spec, list):
        return "[" + ", ".join(spec_text(v) for v in spec) + "]"
    if isinstance(spec, tuple):
        inner = ", ".join(spec_text(v) for v in spec)
        return f"({inner},)" if len(spec) == 1 else f"({inner})"
    if spec is torch_specs()._Replicate:
        return "_Replicate"
    if _is_replicate(spec):
        return "_Replicate()"
    return str(spec)


def _check_leaves(spec: Any, name: str, rank: int) -> None:
    mb = torch_specs()
    for leaf in pytree.tree_leaves(spec):
        if _is_replicate(leaf):
            continue
        if not isinstance(leaf, mb.TensorChunkSpec):
            raise TypeError(
                f"rank {rank}: {name} holds {leaf!r} ({type(leaf).__name__}); its leaves must "
                "be TensorChunkSpec(split_dim) or _Replicate() "
                "(torch.distributed.pipelining.microbatch)"
            )
        _check_dim(leaf, name, rank)


def _check_dim(leaf: Any, name: str, rank: int) -> None:
    dim = leaf.split_dim
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(
            f"rank {rank}: {name} holds a TensorChunkSpec whose split_dim {dim!r} is a "
            f"{type(dim).__name__}, not an int"
        )


def chunk_specs(
    args_chunk_spec: Any, kwargs_chunk_spec: Any, output_merge_spec: Any, rank: int
) -> ChunkSpecs:
    """The runtime's three specs, their types checked (at construction, naming the
    argument and the rank); what they cannot be checked against before a step is checked
    when the step splits or merges."""
    if args_chunk_spec is None and kwargs_chunk_spec is None and output_merge_spec is None:
        return ChunkSpecs()
    mb = torch_specs()
    if args_chunk_spec is not None:
        if not isinstance(args_chunk_spec, tuple | list):
            raise TypeError(
                f"rank {rank}: args_chunk_spec must be a tuple, a spec per positional argument "
                f"of stage 0 (xgrad's step gives it one, the inputs: (TensorChunkSpec(1),) "
                f"for sequence-first inputs), got {spec_text(args_chunk_spec)}"
            )
        _check_leaves(args_chunk_spec, "args_chunk_spec", rank)
        args_chunk_spec = tuple(args_chunk_spec)
    if kwargs_chunk_spec is not None:
        if not isinstance(kwargs_chunk_spec, dict) or not all(
            isinstance(k, str) for k in kwargs_chunk_spec
        ):
            raise TypeError(
                f"rank {rank}: kwargs_chunk_spec must be a dict from keyword names to specs, "
                f"got {spec_text(kwargs_chunk_spec)}"
            )
        for key, spec in kwargs_chunk_spec.items():
            _check_leaves(spec, f"kwargs_chunk_spec[{key!r}]", rank)
    for leaf in pytree.tree_leaves(output_merge_spec):
        if isinstance(leaf, mb.TensorChunkSpec):
            _check_dim(leaf, "output_merge_spec", rank)
    return ChunkSpecs(args_chunk_spec, kwargs_chunk_spec, output_merge_spec)


def _is_node(spec: Any) -> bool:
    return isinstance(spec, tuple | list | dict)


def _has_dict(spec: Any) -> bool:
    if isinstance(spec, dict):
        return True
    return isinstance(spec, tuple | list) and any(_has_dict(s) for s in spec)


def _prefix(spec: Any, value: Any) -> list[Any] | None:
    """Per leaf of ``value`` (in pytree order), its spec: ``spec`` as a prefix of its
    structure, a dict's specs matched by key; ``None`` when it is not one."""
    if not _is_node(spec):
        return [spec] * len(pytree.tree_leaves(value))
    if isinstance(spec, dict):
        if not isinstance(value, dict) or set(spec) != set(value):
            return None
        keys: Any = value  # pytree flattens a dict in its own order
    elif not isinstance(value, tuple | list) or len(spec) != len(value):
        return None
    else:
        keys = range(len(value))
    found: list[Any] = []
    for key in keys:
        inner = _prefix(spec[key], value[key])
        if inner is None:
            return None
        found += inner
    return found


def leaf_specs(spec: Any, value: Any) -> tuple[list[Any], bool] | None:
    """Per leaf of ``value``, its spec, and whether it was found by torch's rule.

    ``spec`` as a prefix of ``value``'s structure first; else torch's own rule, which
    pairs the flattened spec with the flattened value leaf by leaf (structures unchecked:
    ``(TensorChunkSpec(1),)`` for a single tensor), taken where the leaves are as many and
    the spec holds no dict (torch pairs dicts by position: names would be swapped unseen).
    ``None``: neither."""
    found = _prefix(spec, value)
    if found is not None:
        return found, False
    leaves = pytree.tree_leaves(spec)
    if not _has_dict(spec) and len(leaves) == len(pytree.tree_leaves(value)):
        return leaves, True
    return None


class _Name:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def outline(value: Any) -> str:
    """``value``'s structure, its leaves by type (for an error message)."""
    return repr(pytree.tree_map(lambda leaf: _Name(type(leaf).__name__), value))


def at_rank(rank: int | None) -> str:
    """An error message's start: the rank, where known."""
    return "" if rank is None else f"rank {rank}: "


def mismatch(spec_name: str, spec: Any, name: str, value: Any, rank: int | None) -> ValueError:
    """The error for a spec that fits ``value`` neither as a prefix nor by torch's rule."""
    return ValueError(
        f"{at_rank(rank)}{spec_name} {spec_text(spec)} does not fit {name}, structured "
        f"{outline(value)}: give one spec for the whole value, or a pytree of specs of its "
        "structure (a dict's by its keys)"
    )


def _split_leaf(
    leaf: Any, spec: Any, m: int, label: str, spec_name: str, rank: int, rows: Rows | None
) -> list[Any]:
    if _is_replicate(spec) or not isinstance(leaf, torch.Tensor):
        return [leaf] * m  # a non-tensor under a TensorChunkSpec: whole, as by default
    dim, ndim = spec.split_dim, leaf.dim()
    if ndim == 0:
        raise ValueError(
            f"rank {rank}: {label} is a 0-dim tensor, and {spec_name} is {spec}: it has no "
            f"dim {dim} to split into {m} microbatches (_Replicate() gives it whole to each)"
        )
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"rank {rank}: {spec_name} is {spec}, and {label} has {ndim} dims (shape "
            f"{list(leaf.shape)}): split_dim must be in [{-ndim}, {ndim - 1}]"
        )
    what = f"{label} size {leaf.shape[dim]} along dim {dim} ({spec_name} {spec})"
    return split_rows(leaf, m, dim, what, rank, rows)


def split_by_spec(
    value: Any, spec: Any, m: int, name: str, spec_name: str, rank: int, rows: Rows | None = None
) -> list[Any]:
    """``value`` as m microbatches, as ``spec`` (a spec or a pytree of them) splits it
    (``tensor_split``, uneven ones too, as torch's), each tensor's size noted in ``rows``.

    Raises:
        ValueError: a spec that does not fit ``value``'s structure; a tensor whose
            split_dim is out of range, or 0-dim, or whose size along it is smaller than
            m (naming the value, the spec and the rank).
    """
    found = leaf_specs(spec, value)
    if found is None:
        raise mismatch(spec_name, spec, name, value, rank)
    paths, tree = pytree.tree_flatten_with_path(value)
    columns = [
        _split_leaf(leaf, s, m, name + pytree.keystr(path), spec_name, rank, rows)
        for (path, leaf), s in zip(paths, found[0], strict=True)
    ]
    return [pytree.tree_unflatten([c[k] for c in columns], tree) for k in range(m)]


def split_inputs(
    inputs: Any, spec: tuple[Any, ...], m: int, rank: int, rows: Rows | None = None
) -> list[Any]:
    """Stage 0's inputs as m microbatches, as ``args_chunk_spec`` splits its one
    positional argument (or, torch's way, as many leaf specs as the inputs have leaves)."""
    if len(spec) == 1:
        return split_by_spec(inputs, spec[0], m, "inputs", "args_chunk_spec[0]", rank, rows)
    if leaf_specs(spec, (inputs,)) is None:
        raise ValueError(
            f"rank {rank}: args_chunk_spec {spec_text(spec)} holds {len(spec)} specs, and "
            "xgrad's step gives stage 0 one positional argument, the inputs (structured "
            f"{outline(inputs)}): give (spec,), spec a TensorChunkSpec or a pytree of them "
            "of the inputs' structure"
        )
    chunks = split_by_spec((inputs,), spec, m, "inputs", "args_chunk_spec", rank, rows)
    return [mb[0] for mb in chunks]


def split_keywords_by_spec(
    keywords: dict[str, Any], spec: dict[str, Any], m: int, rank: int, rows: Rows | None = None
) -> list[dict[str, Any]]:
    """The model's keywords as m microbatches', each split as ``kwargs_chunk_spec`` names
    it (by name: torch pairs them by position).

    Raises:
        ValueError: a keyword the spec does not name, or a name it gives that the step does
            not (as torch's schedules, which assert the two alike), or as
            :func:`split_by_spec`.
    """
    missing = [name for name in keywords if name not in spec]
    extra = [name for name in spec if name not in keywords]
    if missing or extra:
        found = []
        if missing:
            found.append(f"has no spec for keyword(s) {missing} this step gives")
        if extra:
            found.append(f"names {extra}, which this step does not give")
        raise ValueError(
            f"rank {rank}: kwargs_chunk_spec {' and '.join(found)} (it gives "
            f"{list(keywords)}); as torch's schedules, a spec names exactly the keywords of "
            "each step given any (TensorChunkSpec(dim), or _Replicate() for a value given "
            "whole to every microbatch)"
        )
    columns = {
        name: split_by_spec(
            value, spec[name], m, f"keyword {name!r}", f"kwargs_chunk_spec[{name!r}]", rank, rows
        )
        for name, value in keywords.items()
    }
    return [{name: column[k] for name, column in columns.items()} for k in range(m)]
