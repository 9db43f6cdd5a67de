"""The DDP's collectives on its step watch's private group, every wait through the watch.

Separate from :mod:`.ddp_failure` because the watch does not issue collectives: it owns
the failure channel, the private group and the bounded waits, while this is the
:class:`~xgrad.backend.Comm` the reducer, ``join()`` and the buffer broadcasts call:
each wait goes through the watch, an all-reduce's as a :mod:`.ddp_watched` work. A sparse
bucket whose device the group's backend cannot all-reduce sparse tensors on (NCCL) is
summed by all-gather instead (:mod:`.sparse_gather`), bit-identical to gloo's sum.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from xgrad.torch_backend.comm import TorchComm
from xgrad.torch_backend.ddp_failure import StepWatch
from xgrad.torch_backend.ddp_split import Halves, pieces, wanted_pieces
from xgrad.torch_backend.ddp_watched import WatchedWork
from xgrad.torch_backend.sparse_gather import SparseGather, gathers_sparse

__all__ = ["WatchedComm"]

_SUM = dist.AllreduceOptions()  # ReduceOp.SUM


class WatchedComm(TorchComm):
    """:class:`TorchComm` on the watch's private group, every wait through the watch.

    The object collectives are built from tensor collectives (sizes, then padded bytes),
    because ``broadcast_object_list`` and ``all_gather_object`` have no asynchronous form
    and so could only be bounded by the group's own timeout.
    """

    #: whether a sparse bucket is summed by all-gather: ``None`` decides per bucket, by
    #: the group's backend for the gradient's device (:func:`.sparse_gather.gathers_sparse`);
    #: ``True`` forces it, which is how the tests run that path on gloo (whose CPU and CUDA
    #: backends both all-reduce sparse tensors themselves).
    _gather_sparse: bool | None = None

    def __init__(self, watch: StepWatch) -> None:
        super().__init__(watch.user_group, timeout=watch.timeout)
        self.watch = watch
        self._backend = str(dist.get_backend(watch.user_group))
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if self._backend == "nccl"
            else torch.device("cpu")
        )
        self._pieces = wanted_pieces()

    @property  # type: ignore[override]
    def group(self) -> Any:
        return self.watch.current_group()

    @group.setter
    def group(self, value: Any) -> None:  # TorchComm's constructor sets the user's group
        pass

    def _run(self, work: Any, what: str) -> None:
        # The forward pass's collectives (agreement, broadcasts), never a bucket's: a skip
        # note is not a failure here (StepWaits.wait_event).
        self.watch.wait_work(work, what, self._device.type == "cuda", skips=False)

    def allreduce(  # type: ignore[override]
        self, buffer: torch.Tensor
    ) -> WatchedWork | SparseGather:
        group = self.group
        if buffer.is_sparse and (
            gathers_sparse(group, buffer.device)
            if self._gather_sparse is None
            else self._gather_sparse
        ):
            # Its layout is gathered and checked before this returns; the sum, in place
            # as gloo's, when the reducer waits for the bucket.
            return SparseGather(buffer, group, self._wait_on(buffer), in_place=True)
        if buffer.is_complex():  # c10d reduces complex numbers as pairs of reals
            work = dist.all_reduce(buffer, group=group, async_op=True)
        elif (n := pieces(buffer, self._pieces, self.size, self._backend)) > 1:
            # Two ranks: the same bits in any cut, and the halves overlap (ddp_split).
            work = Halves([group.allreduce([p], _SUM) for p in buffer.chunk(n)], buffer)
        else:
            # The group's own call: what PyTorch's C++ reducer calls, without the checks
            # of ``dist.all_reduce`` (which cost as much again, and hold for a bucket).
            work = group.allreduce([buffer], _SUM)
        return WatchedWork(work, buffer, self.watch, f"allreduce of {buffer.numel()} elements")

    def _wait_on(self, buffer: torch.Tensor) -> Callable[[Any, str], None]:
        """A watched wait for the collectives of ``buffer``'s device."""
        cuda = buffer.is_cuda
        return lambda work, what: self.watch.wait_work(work, what, cuda)

    def _sizes(self, n: int) -> list[int]:
        mine = torch.tensor([n], dtype=torch.int64, device=self._device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self._device) for _ in range(self.size)]
        self._run(dist.all_gather(sizes, mine, group=self.group, async_op=True), "allgather")
        return [int(s.item()) for s in sizes]

    def _bytes(self, obj: Any, length: int) -> torch.Tensor:
        data = pickle.dumps(obj)
        out = torch.zeros(length, dtype=torch.uint8)
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return out.to(self._device)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by group rank (two watched allgathers)."""
        sizes = self._sizes(len(pickle.dumps(obj)))
        longest = max(sizes)
        outs = [torch.zeros(longest, dtype=torch.uint8, device=self._device) for _ in sizes]
        work = dist.all_gather(outs, self._bytes(obj, longest), group=self.group, async_op=True)
        self._run(work, "allgather of objects")
        return [
            pickle.loads(o[:s].cpu().numpy().tobytes()) for o, s in zip(outs, sizes, strict=True)
        ]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Group rank ``src``'s ``obj`` on every rank (two watched broadcasts)."""
        data = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._device)
        work = dist.broadcast(size, group=self.group, group_src=src, async_op=True)
        self._run(work, f"broadcast from rank {src}")
        buf = self._bytes(obj, int(size.item())) if self.rank == src else None
        if buf is None:
            buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=self._device)
        work = dist.broadcast(buf, group=self.group, group_src=src, async_op=True)
        self._run(work, f"broadcast of an object from rank {src}")
        return pickle.loads(buf.cpu().numpy().tobytes())

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` with group rank ``src``'s values (watched, per dtype)."""
        by_key: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_key.setdefault((t.dtype, t.device), []).append(t)
        for members in by_key.values():
            flat = torch.cat([t.detach().reshape(-1) for t in members])
            work = dist.broadcast(flat, group=self.group, group_src=src, async_op=True)
            self._run(work, f"broadcast of buffers from rank {src}")
            offset = 0
            with torch.no_grad():
                for t in members:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
