"""xgrad's ``Comm`` over a ``torch.distributed`` process group, with bounded waits."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT_S", "CollectiveWork", "FutureWork", "TorchComm"]

#: seconds any single wait on a collective may block before it raises.
DEFAULT_TIMEOUT_S = 300.0


class CollectiveWork:
    """An in-flight c10d collective whose ``wait()`` returns its tensor.

    c10d's ``Work.wait()`` without a timeout waits forever (on gloo, up to the group's
    timeout at best); this one always passes a bounded timeout.
    """

    __slots__ = ("_result", "_timeout", "_work")

    def __init__(self, work: Any, result: torch.Tensor, timeout: float) -> None:
        self._work = work
        self._result = result
        self._timeout = timeout

    def wait(self) -> torch.Tensor:
        self._work.wait(timedelta(seconds=self._timeout))
        return self._result

    def get_future(self) -> torch.futures.Future[Any]:
        """The collective's own future (what PyTorch's comm hooks chain ``then`` on)."""
        return self._work.get_future()


class FutureWork:
    """A ``torch.futures.Future`` seen as an xgrad ``Work``, with a bounded ``wait()``.

    ``Future.wait()`` has no timeout; here the waiter blocks on an event that the future's
    completion callback sets, so a hook whose collective never completes raises
    ``TimeoutError`` instead of hanging the backward pass.
    """

    __slots__ = ("_done", "_future", "_name", "_timeout")

    def __init__(self, future: torch._C.Future, timeout: float, name: str = "") -> None:
        self._future = future
        self._timeout = timeout
        self._name = name
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    def wait(self) -> Any:
        if not self._done.wait(self._timeout):
            raise TimeoutError(
                f"{self._name or 'a communication future'} did not complete within "
                f"{self._timeout:g} s"
            )
        value = self._future.wait()  # (not value(): orders the current CUDA stream after it)
        # PyTorch's collectives complete their futures with a one-element list.
        if isinstance(value, list) and len(value) == 1:
            return value[0]
        return value


class TorchComm:
    """What xgrad's reducer needs of a process group, on ``torch.distributed``.

    Args:
        group: the process group (``None``: the default group).
        timeout: seconds a wait on an asynchronous collective may block.
    """

    def __init__(self, group: Any = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call init_process_group (torchrun sets "
                "the environment for it) or use xgrad.torch_backend.spawn"
            )
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.group = group
        self.timeout = float(timeout)
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def allreduce(self, buffer: torch.Tensor) -> CollectiveWork:
        """Start an asynchronous in-place SUM of ``buffer`` over the group."""
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        return CollectiveWork(work, buffer, self.timeout)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return group rank ``src``'s ``obj`` on every rank (bounded by the group's timeout)."""
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=src)
        return box[0]

    def allgather_object(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj``, indexed by group rank."""
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` in place with group rank ``src``'s values (flattened per dtype)."""
        if not tensors:
            return
        by_key: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_key.setdefault((t.dtype, t.device), []).append(t)
        for group in by_key.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            dist.broadcast(flat, group=self.group, group_src=src)
            offset = 0
            with torch.no_grad():
                for t in group:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t))
                    offset += n
