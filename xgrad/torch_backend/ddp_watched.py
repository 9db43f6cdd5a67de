"""What a DDP waits on, each wait through its :class:`~.ddp_failure.StepWatch`.

A collective's ``Work`` (:class:`WatchedWork`, the reducer's buckets and the DDP's other
collectives) and a communication hook's future (:class:`WatchedFuture`): waiting is
bounded and watched, and a failure is named (a peer's, a dead or frozen peer, or this
rank's own hook raising).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from xgrad.heartbeat import COLLECTIVE, waiting_for
from xgrad.raising import raise_from

if TYPE_CHECKING:
    from xgrad.torch_backend.ddp_failure import StepWatch

__all__ = ["WatchedFuture", "WatchedWork", "run_deferred"]


def _hook_raised(exc: BaseException) -> bool:
    """Whether a hook future failed in the hook's own Python code (its ``then`` chain),
    not in a transfer: that is this rank's failure, named at once, with no wait for a
    peer's heartbeat to stop. Gloo's transfer failures are ``RuntimeError``s."""
    prefix = "Got the following error when running the callback: "
    if not isinstance(exc, RuntimeError):
        return True
    name = str(exc)[len(prefix) :].split(":", 1)[0] if str(exc).startswith(prefix) else ""
    return name.isidentifier() and name.endswith("Error") and not name.startswith(("Run", "Dist"))


def run_deferred(watch: StepWatch) -> None:
    """What a wait of this DDP's owes first, if anything: a round that ``join()`` entered
    at the pass's first gradient hook and reads late (:mod:`.join_rounds`), so that a step
    some ranks left without a backward pass raises at once instead of waiting out the
    timeout for buckets that never come."""
    read, watch.deferred = watch.deferred, None
    if read is not None:
        read()


class WatchedWork:
    """An in-flight collective of a :class:`~.ddp_watched_comm.WatchedComm`: ``wait()`` is watched and bounded."""

    __slots__ = ("_result", "_watch", "_what", "_work")

    def __init__(self, work: Any, result: torch.Tensor, watch: StepWatch, what: str) -> None:
        self._work = work
        self._result = result
        self._watch = watch
        self._what = what

    def wait(self) -> torch.Tensor:
        if self._watch.deferred is not None:
            run_deferred(self._watch)
        self._watch.wait_work(self._work, self._what, self._result.is_cuda)
        return self._result

    def get_future(self) -> torch.futures.Future[Any]:
        """The collective's own future (what PyTorch's comm hooks chain ``then`` on)."""
        return self._work.get_future()


class WatchedFuture:
    """A communication hook's future as a reducer ``Work``, waited on through the watch."""

    __slots__ = ("_complex", "_done", "_future", "_watch", "_what")

    def __init__(
        self, future: torch._C.Future, watch: StepWatch, what: str, *, complex_: bool = False
    ) -> None:
        self._future = future
        self._watch = watch
        self._what = what
        # a bucket of complex gradients, shown to the hook as reals: its result back as complex
        self._complex = complex_
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    def wait(self) -> Any:
        if self._watch.deferred is not None:
            run_deferred(self._watch)
        # Published until the failure, if any, is worded (as ``StepWatch.wait_work`` does):
        # a peer timing out meanwhile, whose own hook never launched the collective, must
        # not take this rank, whose collective just failed on gloo's timeout, for a late one.
        before = waiting_for(COLLECTIVE)
        try:
            self._watch.wait_event(self._done, self._what)
            try:
                # ``wait()``, not ``value()``: a CUDA future (NCCL's, a hook's ``then``)
                # completes when its work is queued, and only ``wait()`` makes the current
                # stream wait for the streams that write the result; ``value()`` would read
                # the bucket while NCCL's or the callback's stream may still be writing it.
                # The future is complete here, so this does not block.
                value = self._future.wait()
            except Exception as exc:  # the collective or the hook's own chain failed
                raise_from(self._watch.failed(exc, self._what, posted=_hook_raised(exc)), exc)
        finally:
            waiting_for(before)
        # PyTorch's collectives complete their futures with a one-element list.
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if self._complex and isinstance(value, torch.Tensor) and not value.is_complex():
            value = torch.view_as_complex(value.contiguous().view(-1, 2))
        return value
