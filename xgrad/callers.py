"""Where a warning should point: the user's line, past xgrad's and torch's frames.

A fixed ``stacklevel`` counts frames, and the frames between a user's call and the
warning differ by path: ``ddp(x)`` goes through ``nn.Module.__call__``, under
``torch.compile`` through dynamo's frames as well, so a warning at a fixed level pointed
into ``torch/_dynamo/eval_frame.py`` instead of the user's script. (Python 3.12's
``skip_file_prefixes`` does this; xgrad supports 3.10.)
"""

from __future__ import annotations

import sys

__all__ = ["user_stacklevel"]

#: the packages whose frames are not the user's.
LIBRARIES = ("xgrad", "torch")


def _library(module: object) -> bool:
    name = module if isinstance(module, str) else ""
    return any(name == p or name.startswith(p + ".") for p in LIBRARIES)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the caller of this
    function, point at the first frame outside xgrad and torch (1, the caller itself,
    when every frame is inside them)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and _library(frame.f_globals.get("__name__")):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level if frame is not None else 1
