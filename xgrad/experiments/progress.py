"""Progress bars for experiment runs (tqdm on stderr; plain iteration without it)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

__all__ = ["progress"]


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """Iterate over ``items`` with a bar on stderr (only on a terminal, so logs and tests
    stay clean; tqdm is optional: ``pip install 'xgrad[plot]'``)."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield from items
        return
    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False, disable=None)
