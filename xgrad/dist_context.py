"""A distributed backward pass shared by in-process workers: mailboxes, failure, release.

The engine (:mod:`xgrad.engine`) runs each worker's graph; this context carries the
gradients ``recv`` nodes send back to the matching ``send`` node of another worker, makes
the first failure on any worker every worker's, and is released everywhere when the pass
ends, so the next pass starts clean. Every wait is bounded by its ``timeout``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from xgrad.engine_errors import DistBackwardError

__all__ = ["DEFAULT_TIMEOUT_S", "DistContext"]

#: seconds a worker waits for another in a distributed pass, unless told otherwise.
DEFAULT_TIMEOUT_S = 60.0


class DistContext:
    """One distributed backward pass shared by in-process workers (threads).

    The forward pass records, for every tensor sent from worker A to worker B, a ``send``
    node in A's graph and a ``recv`` node in B's graph, and links them with :meth:`link`.
    In the backward pass B's ``recv`` node delivers its gradient to A's ``send`` node.

    A worker whose ``recv`` node was not reached still tells the other side (with no
    gradient) when it finishes, so no worker waits for a gradient that cannot come. Every
    wait is bounded by ``timeout`` seconds; running past it fails the pass, naming the
    worker that waited.
    """

    _ids = itertools.count(1)

    def __init__(self, workers: Iterable[int], *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.context_id = next(DistContext._ids)
        self.workers = tuple(sorted(set(workers)))
        if not self.workers:
            raise ValueError("workers is empty; a distributed pass needs at least one worker")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds")
        self.timeout = timeout
        self._routes: dict[tuple[int, int], tuple[int, int]] = {}
        self._sends: dict[int, list[int]] = {w: [] for w in self.workers}
        self._cond = threading.Condition()
        self._mail: dict[int, deque[tuple[int, Any]]] = {w: deque() for w in self.workers}
        self._done: set[int] = set()
        self._released: set[int] = set()
        #: ``(worker, node, node name, message)`` of the first failure, if any.
        self.error: tuple[int, int, str, str] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        """Refused with a pointer to what works across processes.

        The context is its workers' shared memory (mailboxes, a lock): a copy in another
        process would never see the others' gradients, and its workers would wait out
        the timeout. Processes use the torch backend's distributed autograd instead.
        """
        raise TypeError(
            f"DistContext {self.context_id} cannot be pickled: it is shared by worker threads "
            "of one process. For workers in several processes use "
            "xgrad.torch_backend.dist_autograd (context, send, recv, backward, get_gradients) "
            "on a torch.distributed process group"
        )

    def link(self, send_worker: int, send_node: int, recv_worker: int, recv_node: int) -> None:
        """Record that ``recv_node`` on ``recv_worker`` returns its gradient to ``send_node``."""
        for w in (send_worker, recv_worker):
            if w not in self._mail:
                raise ValueError(f"worker {w} is not in this context's workers {self.workers}")
        key = (recv_worker, recv_node)
        if key in self._routes:
            raise ValueError(f"recv node {recv_node} of worker {recv_worker} is linked twice")
        self._routes[key] = (send_worker, send_node)
        self._sends[send_worker].append(send_node)

    def sends_of(self, worker: int) -> tuple[int, ...]:
        return tuple(self._sends[worker])

    def recvs_of(self, worker: int) -> dict[int, tuple[int, int]]:
        """``{recv node: (send worker, send node)}`` for ``worker``'s recv nodes."""
        return {r: dst for (w, r), dst in self._routes.items() if w == worker}

    def deliver(self, recv_worker: int, recv_node: int, grad: Any) -> None:
        """Send ``grad`` (None: no gradient) from a recv node to its send node's worker."""
        try:
            peer, send_node = self._routes[(recv_worker, recv_node)]
        except KeyError:
            raise ValueError(
                f"recv node {recv_node} of worker {recv_worker} is not linked to a send node"
            ) from None
        with self._cond:
            self._mail[peer].append((send_node, grad))
            self._cond.notify_all()

    def receive(self, worker: int) -> tuple[int, Any]:
        """Wait for the next ``(send node, gradient)`` for ``worker`` (bounded; raises on failure)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                if self.error is not None:
                    raise self._copy_error(worker)
                if self._mail[worker]:
                    return self._mail[worker].popleft()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        raise self.fail(
            worker, -1, "", f"timed out after {self.timeout}s waiting for gradients from peers"
        )

    def fail(self, worker: int, node: int, node_name: str, message: str) -> DistBackwardError:
        """Record the pass's first error and wake every worker; returns this worker's copy."""
        with self._cond:
            if self.error is None:
                self.error = (worker, node, node_name, message)
            self._cond.notify_all()
            return self._copy_error(worker)

    def finish(self, worker: int) -> None:
        """Wait until every worker finished its part; raises if any failed (bounded)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            self._done.add(worker)
            self._cond.notify_all()
            while True:
                if self.error is not None:
                    raise self._copy_error(worker)
                if len(self._done) == len(self.workers):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(self.workers) - self._done)
                    break
                self._cond.wait(left)
        raise self.fail(
            worker, -1, "", f"timed out after {self.timeout}s; workers {missing} did not finish"
        )

    def release(self, worker: int) -> None:
        with self._cond:
            self._released.add(worker)
            self._mail[worker].clear()

    @property
    def released(self) -> bool:
        """True once every worker let go of the context."""
        with self._cond:
            return len(self._released) == len(self.workers)

    def raise_if_failed(self, worker: int) -> None:
        """Stop early: raise this worker's copy of the pass's error, if another worker failed."""
        with self._cond:
            if self.error is not None:
                raise self._copy_error(worker)

    def _copy_error(self, worker: int) -> DistBackwardError:
        assert self.error is not None
        origin, node, node_name, message = self.error
        return DistBackwardError(self.context_id, worker, node, node_name, message, origin)
