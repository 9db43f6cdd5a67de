"""Do all ranks agree? The comparison half of the "hang oracle" checks, backend-neutral.

Before a distributed step that would hang or silently mix data when ranks disagree (a
pipeline schedule, a bucket plan), every rank contributes a short digest through one small
collective of its backend; :func:`disagreement` turns the gathered digests (and, only when
they differ, the gathered descriptions) into one message that every rank raises alike.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["disagreement", "first_difference"]


def first_difference(texts: Sequence[str]) -> tuple[int, str] | None:
    """The first line on which ``texts`` (one per rank) differ, and that line of each rank."""
    split = [t.splitlines() for t in texts]
    longest = max((len(lines) for lines in split), default=0)
    for i in range(longest):
        row = [lines[i] if i < len(lines) else "<missing>" for lines in split]
        if len(set(row)) > 1:
            shown = "; ".join(f"rank {r}: {line!r}" for r, line in enumerate(row))
            return i, shown
    return None


def disagreement(
    what: str, digests: Sequence[str], texts: Sequence[str] | None = None
) -> str | None:
    """``None`` when every rank's digest is the same, else a message naming the ranks.

    Args:
        what: what was compared ("pipeline schedule").
        digests: one per rank, in rank order.
        texts: optional descriptions per rank (gathered only on disagreement), for the first
            differing line.
    """
    groups: dict[str, list[int]] = {}
    for r, d in enumerate(digests):
        groups.setdefault(d, []).append(r)
    if len(groups) <= 1:
        return None
    parts = [f"ranks {ranks} have digest {d[:12]}" for d, ranks in groups.items()]
    message = f"ranks disagree on the {what}: " + "; ".join(parts)
    if texts is not None:
        first = first_difference(texts)
        if first is not None:
            message += f"; first difference at line {first[0]}: {first[1]}"
    return message
