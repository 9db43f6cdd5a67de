"""Construction-time agreement across ranks: same parameters everywhere, rank 0's state."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from xgrad.torch_backend.comm import TorchComm

__all__ = [
    "ModelMismatchError",
    "broadcast_state",
    "describe_params",
    "verify_params_across_ranks",
]


class ModelMismatchError(ValueError, RuntimeError):
    """The model differs across ranks (raised on every rank, at construction).

    A ``RuntimeError``, as PyTorch's DDP raises ("DDP expects same model across all
    ranks"), so code written for it catches this; and a ``ValueError``, as xgrad's
    callers catch a bad argument.
    """


#: one parameter as ranks compare it: (name, shape, dtype name).
ParamInfo = tuple[str, tuple[int, ...], str]


def describe_params(names: Sequence[str], params: Sequence[torch.Tensor]) -> list[ParamInfo]:
    """What ranks must agree on, per parameter: name, shape and dtype."""
    return [
        (name, tuple(p.shape), str(p.dtype).removeprefix("torch."))
        for name, p in zip(names, params, strict=True)
    ]


def first_mismatch(infos: Sequence[Sequence[ParamInfo]]) -> str | None:
    """Describe the first way a rank's parameters differ from rank 0's, or ``None``.

    Names alone may differ (a wrapper module, say); shapes and dtypes may not, since the
    buckets are laid out from them and the collectives would silently mix values.
    """
    ref = infos[0]
    for rank, mine in enumerate(infos[1:], start=1):
        if len(mine) != len(ref):
            return (
                f"rank {rank} has {len(mine)} parameters to reduce but rank 0 has {len(ref)}"
                + _first_extra(ref, mine, rank)
            )
        for i, (a, b) in enumerate(zip(ref, mine, strict=True)):
            if a[1:] != b[1:]:
                return (
                    f"parameter {i} differs: rank {rank} has {b[0]!r} with shape {list(b[1])} "
                    f"and dtype {b[2]}, rank 0 has {a[0]!r} with shape {list(a[1])} and "
                    f"dtype {a[2]}"
                )
    return None


def _first_extra(ref: Sequence[ParamInfo], mine: Sequence[ParamInfo], rank: int) -> str:
    for i, (a, b) in enumerate(zip(ref, mine)):  # noqa: B905 (lengths differ on purpose)
        if a != b:
            return f"; the first difference is parameter {i}: rank {rank} {b}, rank 0 {a}"
    i = min(len(ref), len(mine))
    extra = ref[i] if len(ref) > len(mine) else mine[i]
    owner = 0 if len(ref) > len(mine) else rank
    return f"; the first parameter only rank {owner} has is {i}: {extra}"


def verify_params_across_ranks(
    comm: TorchComm, names: Sequence[str], params: Sequence[torch.Tensor]
) -> None:
    """Raise the same :class:`ModelMismatchError` on every rank if the models differ.

    Every rank sends its description to every other rank (one ``all_gather_object``),
    so all of them see the mismatch and raise together instead of hanging in a later
    collective that only some ranks enter.
    """
    infos = comm.allgather_object(describe_params(names, params))
    problem = first_mismatch(infos)
    if problem is not None:
        raise ModelMismatchError(
            f"DistributedDataParallel: the model differs across ranks (seen on rank "
            f"{comm.rank}): {problem}"
        )


def broadcast_state(
    comm: TorchComm,
    module: torch.nn.Module,
    *,
    buffers: bool = True,
    ignore: Collection[str] = (),
    src: int = 0,
) -> None:
    """Overwrite every parameter (and buffer) with rank ``src``'s values, in place.

    Names in ``ignore`` (DDP's ``_ddp_params_and_buffers_to_ignore``) keep their values.
    The ranks first compare what they are about to broadcast (names, shapes, dtypes of
    buffers and frozen parameters too, which the parameter check does not cover): the
    broadcast is one flat buffer, so another buffer shape on a rank would silently mix
    values into it, and another dtype aborts the process inside gloo.

    Raises:
        ModelMismatchError: on every rank, naming the first tensor that differs and the ranks.
    """
    named = [(name, p.data) for name, p in module.named_parameters() if name not in ignore]
    if buffers:
        named.extend((name, b.data) for name, b in module.named_buffers() if name not in ignore)
    infos = comm.allgather_object(describe_params([n for n, _ in named], [t for _, t in named]))
    problem = _first_state_mismatch(infos, src)
    if problem is not None:
        raise ModelMismatchError(
            f"DistributedDataParallel: the model's state differs across ranks (seen on rank "
            f"{comm.rank}), so rank {src}'s cannot be broadcast: {problem}"
        )
    comm.broadcast_tensors([t for _, t in named], src=src)


def _first_state_mismatch(infos: Sequence[Sequence[ParamInfo]], src: int) -> str | None:
    """The first parameter or buffer in which a rank differs from rank ``src``, or ``None``."""
    ref = infos[src]
    for rank, mine in enumerate(infos):
        for i in range(max(len(ref), len(mine))):
            a = ref[i] if i < len(ref) else None
            b = mine[i] if i < len(mine) else None
            if a is None or b is None or a[1:] != b[1:]:
                return f"tensor {i}: rank {rank} has {_show(b)}, rank {src} has {_show(a)}"
    return None


def _show(info: ParamInfo | None) -> str:
    if info is None:
        return "nothing"
    return f"{info[0]!r} with shape {list(info[1])} and dtype {info[2]}"
