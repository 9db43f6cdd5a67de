"""Ranks agree before they communicate: one gathered digest, the first difference named.

A collective that ranks enter with different plans does not fail: it mixes values
(buckets of equal size holding different parameters) or aborts deep in the transport
("340 vs 68"). So before the first collective of a plan, every rank contributes a
digest of what it is about to do (one small ``allgather_object``); when the digests
differ, the full descriptions are gathered and every rank raises the same
:class:`DisagreementError`, naming the ranks and the first entry that differs.

What is compared is a :class:`Fingerprint`: named sections ("bucket", "parameter",
"hook", "send", ...) of short canonical strings. DDP compares its bucket plan, parameter
list and communication hook; a pipeline runtime its schedule. Both use this module.

Example:
    >>> fp = Fingerprint.of("bucket plan", bucket=["0: [1, 0]"], hook=["allreduce"])
    >>> first_difference([fp, fp]) is None
    True
    >>> other = Fingerprint.of("bucket plan", bucket=["0: [0, 1]"], hook=["allreduce"])
    >>> print(first_difference([fp, other]))
    bucket 0 differs: rank 0 has '0: [1, 0]', rank 1 has '0: [0, 1]'
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from xgrad.buckets import BucketPlan

__all__ = [
    "DisagreementError",
    "Fingerprint",
    "check_agreement",
    "data_parallel_fingerprint",
    "disagreement_error",
    "first_difference",
]


class _Gather(Protocol):
    """The one thing the check needs of a process group (``xgrad.backend.Comm`` has it)."""

    @property
    def rank(self) -> int: ...

    def allgather_object(self, obj: Any) -> list[Any]: ...


class DisagreementError(ValueError):
    """Ranks were about to run different plans; raised on every rank alike.

    Attributes:
        what: what was compared ("bucket plan", "pipeline schedule", ...).
        section: the section of the first difference ("bucket", "parameter", ...).
        index: the entry of that section that differs first.
        ranks: the ranks whose entry differs from rank 0's.
    """

    def __init__(self, message: str, *, what: str, section: str, index: int, ranks: list[int]):
        super().__init__(message)
        self.what = what
        self.section = section
        self.index = index
        self.ranks = ranks


@dataclass(frozen=True)
class Fingerprint:
    """What one rank is about to run, as named sections of canonical strings.

    Attributes:
        what: the name of the thing compared, for messages.
        sections: ``(section name, entries)`` pairs in the order they are compared; the
            first differing entry of the first differing section is the one reported.
    """

    what: str
    sections: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def of(cls, what: str, **sections: Sequence[str]) -> Fingerprint:
        """Build one from keyword sections, in the order given."""
        return cls(what, tuple((name, tuple(map(str, v))) for name, v in sections.items()))

    @cached_property
    def digest(self) -> str:
        """SHA-256 over every section, so ranks compare 64 characters, not the plans."""
        h = hashlib.sha256(self.what.encode())
        for name, entries in self.sections:
            h.update(b"\0s" + name.encode())
            for entry in entries:
                h.update(b"\0e" + entry.encode())
        return h.hexdigest()


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))


def first_difference(prints: Sequence[Fingerprint]) -> str | None:
    """Describe the first entry where some rank differs from rank 0, or ``None``.

    Ranks are grouped by what they hold, so with three ranks the message reads
    "rank 0 and 2 have ..., rank 1 has ..." rather than listing pairs.
    """
    error = _difference(prints)
    return None if error is None else str(error)


def _difference(prints: Sequence[Fingerprint]) -> DisagreementError | None:
    ref = prints[0]
    if all(p.digest == ref.digest for p in prints):
        return None
    names = [name for name, _ in ref.sections]
    for p in prints[1:]:
        names += [name for name, _ in p.sections if name not in names]
    for name in names:
        per_rank = [dict(p.sections).get(name, ()) for p in prints]
        longest = max(len(entries) for entries in per_rank)
        for i in range(longest):
            held = [entries[i] if i < len(entries) else "(nothing)" for entries in per_rank]
            if all(h == held[0] for h in held):
                continue
            groups: dict[str, list[int]] = {}
            for rank, h in enumerate(held):
                groups.setdefault(h, []).append(rank)
            parts = [
                f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {h!r}"
                for h, ranks in groups.items()
            ]
            differing = [r for r, h in enumerate(held) if h != held[0]]
            return DisagreementError(
                f"{name} {i} differs: " + ", ".join(parts),
                what=ref.what,
                section=name,
                index=i,
                ranks=differing,
            )
    # Same sections and entries but different digests: only ``what`` can differ.
    whats = [p.what for p in prints]
    differing = [r for r, w in enumerate(whats) if w != whats[0]]
    return DisagreementError(
        f"ranks compare different things: {whats!r}",
        what=ref.what,
        section="what",
        index=0,
        ranks=differing,
    )


def check_agreement(comm: _Gather, fingerprint: Fingerprint, *, where: str) -> None:
    """Raise the same :class:`DisagreementError` on every rank unless all fingerprints match.

    Costs one ``allgather_object`` of a 64-character digest when the ranks agree; only
    when they do not is a second one spent on the full descriptions, so every rank can
    name the first difference. Every rank must call this at the same point.

    Args:
        comm: the process group.
        fingerprint: this rank's.
        where: who is checking, for the message ("DistributedDataParallel", ...).
    """
    digests = comm.allgather_object(fingerprint.digest)
    if all(d == digests[0] for d in digests):
        return
    raise disagreement_error(comm.allgather_object(fingerprint), where=where, rank=comm.rank)


def disagreement_error(
    prints: Sequence[Fingerprint], *, where: str, rank: int
) -> DisagreementError:
    """The error every rank raises when the gathered ``prints`` (rank order) differ.

    For a backend that gathers digests its own way (a bounded tensor all-gather, say)
    and calls this only once they differed.
    """
    error = _difference(prints)
    if error is None:  # the digests differed, so the descriptions do too
        raise AssertionError("fingerprints with different digests compared equal")
    return DisagreementError(
        f"{where}: the ranks disagree on the {error.what} (seen on rank {rank}; "
        f"{_ranks(error.ranks)} differ from rank 0): {error}",
        what=error.what,
        section=error.section,
        index=error.index,
        ranks=error.ranks,
    )


def data_parallel_fingerprint(
    plan: BucketPlan,
    params: Sequence[tuple[str, Sequence[int], str]],
    hook: str,
) -> Fingerprint:
    """What data-parallel ranks must agree on before reducing: plan, parameters, hook.

    Buckets come first, so a plan whose buckets hold the same sizes but different
    parameters is reported as the bucket where they differ, with the parameters' names.

    Args:
        plan: the bucket plan in launch order.
        params: per parameter index, ``(name, shape, dtype name)``.
        hook: the communication hook's name (``"allreduce"`` for the default).
    """
    names = [name for name, _, _ in params]

    def member(i: int) -> str:
        return names[i] if 0 <= i < len(names) else f"#{i} (no such parameter)"

    buckets = [
        f"[{', '.join(map(str, b))}] = ({', '.join(member(i) for i in b)}), cap {limit} B"
        for b, limit in zip(plan.buckets, plan.limits, strict=True)
    ]
    described = [f"{name} shape {list(shape)} {dtype}" for name, shape, dtype in params]
    return Fingerprint.of("bucket plan", bucket=buckets, parameter=described, hook=[hook])
