"""Progress bars for experiment runs: the core's :func:`xgrad.progress.progress` (one idea,
one implementation)."""

from __future__ import annotations

from xgrad.progress import progress as progress

__all__ = ["progress"]
