"""The sends of one pipeline step: a stage's output to its consumers on other ranks, the
gradients of its inputs back to their sources.

:class:`StepSends` is the sending half of
:class:`~xgrad.torch_backend.pipeline_comm.StepWire`, whose docstring describes the
messages (a header, then the leaves, or a changed description on the edge's side tag);
kept apart from the receiving half, which posts ahead and pairs each message with its
pass, as that half grew.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from xgrad.pipeline import Action, Kind
from xgrad.torch_backend.pipeline_edges import EdgeBook
from xgrad.torch_backend.pipeline_frame import frame_of, none_code
from xgrad.torch_backend.pipeline_wire import EdgeCache, layout

__all__ = ["Shapes", "StepSends"]

Shapes = list[tuple[torch.Size, torch.dtype]]


class StepSends(EdgeBook):
    """Posting a step's sends (the descriptions carried per edge are ``_edges``, set by
    :class:`~xgrad.torch_backend.pipeline_comm.StepWire`)."""

    _edges: EdgeCache

    def send_forward(self, action: Action, tree: Any, carry: Sequence[bool]) -> None:
        """Post ``tree`` (stage ``action.stage``'s output) to every consumer on another rank."""
        sched, s, mb = self.schedule, action.stage, action.microbatch
        for t in sched.consumers(s):
            if sched.placement[t] == self.rank:
                continue
            edge = (s, t, 0)
            key = ("out", s, t, mb)
            description, tensors = self._edges.describe(key, tree, carry, str(action))
            start = self._edges.last(key)
            works = []
            dev = self._device(s)
            frame = frame_of([] if start is None else layout(start), dev)
            if description == start:
                works = [self._send_one(edge, x) for x in frame.pack(0, mb, tensors)]
                self._expecting(self._peer(edge), Action(t, Kind.RECV_F, mb), works)
            else:
                # The receiver posted the frame of ``start``: it gets the header (and
                # dummies for its leaf buffers); the description and leaves go aside.
                raw = torch.frombuffer(bytearray(description.to_bytes()), dtype=torch.uint8)
                raw = raw.to(dev)
                works = [self._send_one(edge, x) for x in frame.pack(raw.numel(), mb, None)]
                works.append(self._send_one(edge, raw, side=True))
                works += [
                    self._send_one(edge, x.detach().to(dev).contiguous(), True) for x in tensors
                ]
            self._edges.remember(key, description)
            self._remaining[edge] -= 1
            self._forward_sends[(s, t, mb)] = works

    def send_backward(
        self,
        action: Action,
        grads: dict[int, list[torch.Tensor | None]],
        layouts: dict[int, Shapes] | None = None,
    ) -> None:
        """Post the gradients of stage ``action.stage``'s inputs, per source stage. A
        source whose gradients include None has its layout (shape and dtype per leaf) in
        ``layouts``; the Nones are marked in the header's code."""
        s, mb = action.stage, action.microbatch
        for src, parts in grads.items():
            edge = (src, s, 1)
            shapes = None if layouts is None else layouts.get(src)
            code = 0
            if shapes is None:
                frame = frame_of(
                    [(g.shape, g.dtype) for g in parts if g is not None], self._device(s)
                )
            else:
                frame = frame_of(shapes, self._device(s))
                code, parts = none_code(parts, shapes, self._device(s))
            keys = [self._send_one(edge, x) for x in frame.pack(code, mb, parts)]
            self._expecting(self._peer(edge), Action(src, Kind.RECV_B, mb), keys)
            self._remaining[edge] -= 1
