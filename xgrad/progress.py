"""Progress for long runs (crosscheck, benches, experiments): a tqdm bar on a terminal.

On a terminal a bar counts the parts of a run while the lines about each part are
printed above it; elsewhere (logs, pipes, tests) only the lines are written, so output
stays plain text. tqdm is optional (``pip install 'xgrad[plot]'``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

__all__ = ["Progress", "progress"]


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """Iterate over ``items`` with a bar on stderr (only on a terminal)."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield from items
        return
    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False, disable=None)


class Progress:
    """A bar of ``total`` parts on ``stream`` (when it is a terminal) and lines above it.

    Args:
        total: number of parts.
        desc: the bar's label.
        stream: where lines (and the bar) go; None: nowhere.
    """

    def __init__(self, total: int, desc: str, stream: TextIO | None) -> None:
        self._stream = stream
        self._bar: Any = None
        if stream is not None and getattr(stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=stream, leave=False)
            except ImportError:
                pass

    def say(self, text: str) -> None:
        """One line about the run, above the bar."""
        if self._stream is None:
            return
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
        else:
            print(text, file=self._stream, flush=True)

    def advance(self, label: str = "") -> None:
        """One part done; ``label`` names the next."""
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(label)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.close()
