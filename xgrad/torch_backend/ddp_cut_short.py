"""What cut a DDP's backward pass short: the exception autograd raised, for the peers.

A gradient hook of the user's (``p.register_hook(fn)``, a hook on an activation, a
module's backward hook) or an autograd function that raises ends the pass on this rank
without DDP's hooks seeing the exception: autograd runs no code of the DDP on its way
out and keeps nothing of it. The pass is posted to the step's failure channel at the
next forward pass (:func:`.ddp_recover.post_failed_pass`), and the peers' error named
the rank but said only "the backward pass raised an exception". So, once a DDP has
attached its hooks, autograd's engine is entered through :class:`NotingEngine`, which
notes the exception's type and text (bounded: :data:`NOTED_CHARS`) on each DDP whose
backward pass (synchronised or ``no_sync``, whose failure gives up the step it
accumulated for) began within the call and did not finish, and raises it on unchanged.
A :class:`~xgrad.failure.RankError` is not noted: the DDP's own hook that raised it
posted it already, or it is a peer's.

The engine is swapped only while it is torch's own; another one put in its place (by a
profiler, a library) is left alone, and the peers then hear the generic words again.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.autograd.variable import Variable

from xgrad.failure import RankError, describe
from xgrad.torch_backend.ddp_recover import UNFINISHED

__all__ = ["NOTED_CHARS", "NotingEngine", "bounded", "note_backward_errors"]

#: the most characters of an exception's text sent to the peers (a tensor printed in a
#: message can run to megabytes, and every peer reads it from the store).
NOTED_CHARS = 2000

_NONE: frozenset[Any] = frozenset()


def bounded(text: str, limit: int = NOTED_CHARS) -> str:
    """``text``, cut to ``limit`` characters with a note of how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class NotingEngine(torch._C._ImperativeEngine):
    """Torch's autograd engine, noting why a DDP's backward pass was cut short.

    Only the DDP passes that began within this call are noted: one begun before it (the
    outer pass of a reentrant backward, as checkpointing runs one) is noted by the outer
    call, if the exception reaches it. It costs about 1 µs a backward call, nothing a
    gradient.
    """

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        # Between good steps no pass is under way: nothing is copied.
        before = frozenset(UNFINISHED) if UNFINISHED else _NONE
        try:
            return super().run_backward(*args, **kwargs)
        except BaseException as exc:
            if UNFINISHED and not isinstance(exc, RankError):
                with contextlib.suppress(Exception):  # what is raised stays the user's
                    _note(exc, before)
            raise


def _note(exc: BaseException, before: frozenset[Any]) -> None:
    """``exc`` is why the passes begun since ``before`` were cut short (the first noted
    stays: a reentrant pass's exception reaches the outer call too)."""
    text = ""
    for hooks in list(UNFINISHED):  # (one C call: another thread may change the set)
        if hooks not in before and hooks.cut_short is None:
            text = text or bounded(describe(exc))
            hooks.cut_short = text


def note_backward_errors() -> None:
    """Enter autograd through :class:`NotingEngine` from now on (once; not over an engine
    someone else put in torch's place)."""
    if type(Variable._execution_engine) is torch._C._ImperativeEngine:
        Variable._execution_engine = NotingEngine()
