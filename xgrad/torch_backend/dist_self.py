"""A rank's sends to itself in a distributed autograd context: kept in the process.

PyTorch lets a rank RPC itself, its gradient flowing back in the same backward pass.
Here such a tensor never touches the wire, the ledger or the pass: ``send`` keeps a
differentiable copy (a snapshot, as a peer's send is; detached when sent with grad mode
off, as to a peer), ``recv`` takes the oldest, so the received tensor's ``grad_fn`` leads
to the sent one and its gradient flows back within this rank's own part of the pass, as
through any local operation. No message is owed, so
no failure path needs anything of it; what is left unreceived is misuse, named at once.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch

__all__ = ["ToSelf"]


class ToSelf:
    """The tensors this rank sent itself in one context and has not received yet, in order.

    Args:
        me: this rank (for the errors).
    """

    def __init__(self, me: int) -> None:
        self.me = me
        self._queue: deque[torch.Tensor] = deque()

    def send(self, t: torch.Tensor, tracked: bool) -> None:
        """Keep a contiguous copy of ``t``, as a peer receives one: connected to ``t``'s
        graph when ``tracked`` (``t`` requires grad and grad mode is on:
        :func:`~.dist_edges.sends_gradient`), else detached, as a send to a peer is then.
        A detached copy is made outside inference mode, as a peer's receive would be
        there: an inference tensor could not be used with autograd afterwards."""
        modes = contextlib.ExitStack()
        if not tracked and torch.is_inference_mode_enabled():
            modes.enter_context(torch.inference_mode(False))
        with modes:
            source = t if tracked else t.detach()
            if t.layout == torch.strided:
                self._queue.append(source.clone(memory_format=torch.contiguous_format))
            else:
                self._queue.append(source.clone())

    def recv(self) -> torch.Tensor:
        """The oldest tensor sent to itself; refused at once when there is none (no other
        thread can send it later: a context belongs to one thread). Under
        ``inference_mode`` it needs no grad, as a peer's tensor received there."""
        if not self._queue:
            raise RuntimeError(
                f"recv(src={self.me}) on rank {self.me}: this rank has sent itself no tensor "
                "it has not received yet in this context (a send to one's own rank comes "
                "before its recv)"
            )
        t = self._queue.popleft()
        return t.detach() if torch.is_inference_mode_enabled() else t

    def check_received(self) -> None:
        """At the context's exit: every tensor sent to itself was received (else the
        error, which the context reports to every rank as a failure in the forward)."""
        if self._queue:
            raise RuntimeError(
                f"rank {self.me} sent itself {len(self._queue)} tensor(s) in this context "
                "that it did not receive (a send with no matching recv)"
            )
