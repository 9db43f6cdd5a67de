"""Sends and receives that may still be in flight after their pass or context ended, kept referenced.

Gloo drops a send whose buffer is freed, and writes a receive into its buffer when it
lands, so a transfer nobody waits for any more (after a failure, or sends a context did
not wait for) must keep its buffer alive until it completed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["GRAVEYARD", "bury", "bury_sent", "sweep"]

#: sends and receives that may still be in flight when their pass or context ended (a
#: failure, or sends nobody waited for), as ``(work, buffer)``: kept referenced, because
#: gloo drops a send whose buffer is freed and writes a receive into its buffer when it
#: lands. :func:`bury` drops those that completed, so a retry loop does not grow it.
GRAVEYARD: list[tuple[Any, Any]] = []
_sweep_at = 64  # GRAVEYARD's length that triggers the next sweep


def bury(work: Any, buffer: Any) -> None:
    """Keep ``work`` and the ``buffer`` it reads or writes referenced until it completes.

    Completed ones are dropped whenever the list has doubled since the last sweep: a
    sweep costs one ``is_completed()`` per entry, so this stays linear in the buried.
    """
    global _sweep_at
    GRAVEYARD.append((work, buffer))
    if len(GRAVEYARD) >= _sweep_at:
        _sweep_at = max(64, 2 * sweep())


def bury_sent(sent: Sequence[tuple[int, tuple[Any, Any]]]) -> None:
    """:func:`bury` each ``(peer, (work, buffer))`` of a pass's or context's sends."""
    for _, (work, buf) in sent:
        bury(work, buf)


def sweep() -> int:
    """Drop the buried transfers that completed (delivered, or failed by gloo: either way
    gloo no longer touches the buffer); how many are still kept."""
    GRAVEYARD[:] = [entry for entry in GRAVEYARD if not _completed(entry[0])]
    return len(GRAVEYARD)


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except RuntimeError:  # cannot tell: keep it
        return False
