"""A sparse tensor summed over a group by all-gather, where the backend cannot all-reduce it.

NCCL has no sparse all-reduce, so PyTorch's DDP refuses sparse gradients there (an
``nn.Embedding(sparse=True)``). Gloo's sparse all-reduce is itself built from
all-gathers; this does the same with the dense collectives every backend has, in the
same order of operations, so the sum is bit-identical to gloo's ``all_reduce`` of the
same CPU tensors::

    coalesce this rank's tensor
    all-gather every rank's layout: nnz, sparse and dense dimensions, shape, value size
        (every rank checks they agree, and raises naming the ranks that differ, before
        any collective whose sizes depend on them)
    all-gather the indices and the values, each padded to the largest nnz
    rebuild each rank's tensor; add them in rank order; coalesce

Gloo gathers exactly ``nnz`` entries per rank (``allgatherv``); NCCL's all-gather takes
one size, hence the padding, which is cut off before the sum. Gloo sums CUDA tensors on
host copies; this sums on the tensor's device, so on a GPU the bits are not promised.

The layout is gathered and waited on at the start (the other buffers' sizes come from
it); the indices and values are gathered while the caller goes on (the DDP's backward
pass), and summed at :meth:`SparseGather.wait`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SparseGather", "device_backend", "gathers_sparse", "reduces_sparse", "sparse_sum"]

#: the most dimensions a tensor may have here (gloo's sparse all-reduce allows 4 + 4).
MAX_DIMS = 8
#: a rank's layout as gathered: nnz, sparse dims, dense dims, value size, shape (-1 padded).
_LAYOUT = 4 + MAX_DIMS

#: waits for a c10d work; the string says what it is (a watched wait names it on failure).
Wait = Callable[[Any, str], None]


def device_backend(config: str, device_type: str) -> str:
    """The backend that a group whose backend config is ``config`` (as
    ``dist.get_backend_config`` gives it: ``"cpu:gloo,cuda:nccl"``, ``"cuda:nccl"``) runs
    collectives of ``device_type`` tensors on; ``""`` for a device it has none for."""
    for entry in config.split(","):
        device, _, backend = entry.strip().partition(":")
        if device == device_type:
            return backend
    return ""


def reduces_sparse(backend: str) -> bool:
    """Whether c10d backend ``backend`` all-reduces a sparse tensor itself: only gloo does
    (NCCL's ``all_reduce`` raises on one; so would any other's, as far as c10d goes)."""
    return backend == "gloo"


def gathers_sparse(group: Any, device: torch.device) -> bool:
    """Whether a sparse tensor on ``device`` is summed over ``group`` by all-gather: the
    group's backend for that device cannot all-reduce it (decided from the name, not by
    trying: a failed collective may leave the group unusable)."""
    config = str(dist.get_backend_config(group))
    return not reduces_sparse(device_backend(config, device.type))


def _default_wait(work: Any, what: str) -> None:
    work.wait()


class SparseGather:
    """One sparse tensor's sum over ``group`` in flight, by all-gather.

    The constructor coalesces ``tensor``, gathers and checks the ranks' layouts and
    starts the gathers of indices and values; :meth:`wait` sums them.

    Args:
        tensor: this rank's sparse COO tensor (left as it is unless ``in_place``).
        group: the process group (``None``: the default group).
        wait: waits for one c10d work (the DDP's goes through its step watch).
        in_place: copy the sum into ``tensor``, as gloo's all-reduce does, and return it.

    Raises:
        ValueError: the ranks' tensors differ in shape, dimensions or value size (on
            every rank alike, naming the ranks), or this rank's has over :data:`MAX_DIMS`
            dimensions (raised here alone, before any collective).
    """

    __slots__ = ("_gathers", "_in_place", "_input", "_nnz", "_tensor", "_wait")

    def __init__(
        self,
        tensor: torch.Tensor,
        group: Any = None,
        wait: Wait = _default_wait,
        *,
        in_place: bool = False,
    ) -> None:
        if not tensor.is_sparse:
            raise TypeError(f"expected a sparse COO tensor, got layout {tensor.layout}")
        if tensor.dim() > MAX_DIMS:
            raise ValueError(
                f"a sparse tensor of {tensor.dim()} dimensions (shape {list(tensor.shape)}); "
                f"summing by all-gather takes at most {MAX_DIMS}"
            )
        self._tensor = tensor
        self._wait = wait
        self._in_place = in_place
        with torch.no_grad():
            self._input = tensor.coalesce()
        layouts = self._layouts(group)
        _check_layouts(layouts)
        self._nnz = [int(layout[0]) for layout in layouts]
        self._gathers = self._start(group, max(self._nnz))

    def _layouts(self, group: Any) -> list[list[int]]:
        t = self._input
        mine = [t._nnz(), t.sparse_dim(), t.dense_dim(), t.element_size(), *t.shape]
        mine += [-1] * (_LAYOUT - len(mine))
        sent = torch.tensor(mine, dtype=torch.int64, device=t.device)
        got = [torch.empty_like(sent) for _ in range(dist.get_world_size(group))]
        work = dist.all_gather(got, sent, group=group, async_op=True)
        self._wait(work, "allgather of the sparse tensors' layouts")
        return [g.tolist() for g in got]

    def _start(self, group: Any, most: int) -> list[tuple[Any, list[torch.Tensor]]]:
        """The gathers of indices and values, each padded to ``most`` entries (none when
        no rank has an entry: every rank knows ``most``, so all skip alike)."""
        if most == 0:
            return []
        t = self._input
        gathers = []
        # indices are (sparse dims, nnz), values (nnz, dense sizes...): padded on the nnz axis
        for local, axis in ((t._indices(), 1), (t._values(), 0)):
            shape = list(local.shape)
            shape[axis] = most
            padded = local.new_zeros(shape)
            padded.narrow(axis, 0, local.shape[axis]).copy_(local)
            outs = [torch.empty_like(padded) for _ in self._nnz]
            gathers.append((dist.all_gather(outs, padded, group=group, async_op=True), outs))
        return gathers

    def wait(self) -> torch.Tensor:
        """The sum over the group: a new coalesced sparse tensor (``tensor`` itself, the
        sum copied in, when ``in_place``)."""
        t = self._input
        if self._gathers:
            (ind_work, indices), (val_work, values) = self._gathers
            self._wait(ind_work, "allgather of a sparse tensor's indices")
            self._wait(val_work, "allgather of a sparse tensor's values")
        with torch.no_grad():
            if not self._gathers:  # no rank has an entry: the sum of nothing
                total = t.clone()
            else:
                # (their indices came from coalesced tensors: checking them again is waste)
                parts = [
                    torch.sparse_coo_tensor(
                        i.narrow(1, 0, n), v.narrow(0, 0, n), t.shape, check_invariants=False
                    )
                    for i, v, n in zip(indices, values, self._nnz, strict=True)
                ]
                total = parts[0]
                for part in parts[1:]:  # in rank order, in place, as gloo adds them
                    total += part
            total = total.coalesce()
            if self._in_place:
                self._tensor.copy_(total)
                return self._tensor
        return total


def _check_layouts(layouts: list[list[int]]) -> None:
    """Every rank's tensor has rank 0's shape, dimensions and value size; else the
    message (the same on every rank) names each rank that differs, against rank 0."""

    def shown(rank: int) -> str:
        _, sparse, dense, size, *shape = layouts[rank]
        dims = f"{sparse} sparse, {dense} dense dimensions, {size}-byte values"
        return f"rank {rank}'s (shape {shape[: sparse + dense]}, {dims})"

    first = layouts[0][1:]
    odd = [r for r, layout in enumerate(layouts) if layout[1:] != first]
    if odd:
        differ = "differs" if len(odd) == 1 else "differ"
        raise ValueError(
            f"the sparse tensors summed by all-gather do not match: "
            f"{' and '.join(shown(r) for r in odd)} {differ} from {shown(0)}; every "
            f"rank's must have the same shape, sparse and dense dimensions and dtype"
        )


def sparse_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``tensor`` summed over ``group`` by all-gather: a new coalesced sparse tensor, the
    same bits as gloo's ``all_reduce`` of it (see the module docstring)."""
    return SparseGather(tensor, group).wait()
