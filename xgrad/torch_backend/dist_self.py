"""A rank's sends to itself in a distributed autograd context: kept in the process.

PyTorch lets a rank RPC itself, its gradient flowing back in the same backward pass.
Here such a tensor never touches the wire, the ledger or the pass: ``send`` keeps a
differentiable copy (a snapshot, as a peer's send is), ``recv`` takes the oldest, so the
received tensor's ``grad_fn`` leads to the sent one and its gradient flows back within
this rank's own part of the pass, as through any local operation. No message is owed, so
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

    def send(self, t: torch.Tensor) -> None:
        """Keep a copy of ``t``, connected to ``t``'s graph even under ``no_grad`` or
        ``inference_mode`` (as a peer's receive requires grad when the sent tensor does;
        made in inference mode, the copy needed none and the gradient was lost without a
        word), contiguous as a peer's is."""
        modes = contextlib.ExitStack()
        if torch.is_inference_mode_enabled():
            modes.enter_context(torch.inference_mode(False))
        with modes, torch.enable_grad():
            if t.layout == torch.strided:
                self._queue.append(t.clone(memory_format=torch.contiguous_format))
            else:
                self._queue.append(t.clone())

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
