"""What a distributed step's failure is, and the exception each rank raises for it.

A :class:`Failure` is the record a rank posts to the step's failure channel (plain data,
JSON in the store); :class:`RankError` (:class:`RankUnresponsiveError` for a rank lost or
a wait run out) is what every rank raises for it. Kept apart from the channel
(:mod:`xgrad.failure`, the store protocol that posts and polls these records, and which
re-exports every name here) so that each is read on its own. Backend-neutral.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "FAILURE_KINDS",
    "Failure",
    "RankError",
    "RankUnresponsiveError",
    "describe",
    "error_for",
]


#: the kinds of a failure (:attr:`Failure.kind`).
FAILURE_KINDS = frozenset({"error", "unresponsive", "timeout"})


@dataclass(frozen=True)
class Failure:
    """Where a distributed step failed first.

    Attributes:
        rank: the rank it started on (for "unresponsive": the rank that stopped answering).
        where: what that rank was doing, worded by the user of the channel (a node name,
            "comm hook, bucket 0"); empty when the message says it all.
        message: the original error's text (``"ValueError: boom"``).
        kind: ``"error"`` (an exception), ``"unresponsive"`` (a rank died or froze) or
            ``"timeout"`` (a wait ran out while every rank still answered); any other
            kind is a note a backend posts after a step's first failure, not a failure
            (:data:`FAILURE_KINDS`).
    """

    rank: int
    where: str
    message: str
    kind: str = "error"

    def text(self) -> str:
        """``"rank R in WHERE: MESSAGE"`` (``"rank R: MESSAGE"`` without a ``where``)."""
        at = f" in {self.where}" if self.where else ""
        return f"rank {self.rank}{at}: {self.message}"

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"rank": self.rank, "where": self.where, "message": self.message, "kind": self.kind}
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Failure:
        d = json.loads(data.decode())
        return cls(int(d["rank"]), str(d["where"]), str(d["message"]), str(d["kind"]))


class RankError(RuntimeError):
    """A distributed step failed on some rank; every rank of the step raises one.

    The message starts with the origin (``"rank 1 in MulBackward0: ..."``), after an optional
    ``prefix`` a user of the channel adds (``"Error on "``).

    Attributes:
        failure: the :class:`Failure` (``rank``, ``where``, ``message``, ``kind``).
        rank: the rank the failure started on.
        raised_on: the rank raising this copy (None when unknown).
        also: other ranks' failures that had reached this rank when it raised
            (:meth:`FailureChannel.others`), a line each (``"also rank 2: ..."``).
    """

    also: tuple[Failure, ...] = ()  # (a subclass that skips __init__ has none)

    def __init__(
        self,
        failure: Failure,
        raised_on: int | None = None,
        prefix: str = "",
        also: Sequence[Failure] = (),
    ) -> None:
        self.failure = failure
        self.rank = failure.rank
        self.raised_on = raised_on
        self.prefix = prefix
        self.also = tuple(also)
        super().__init__(prefix + failure.text() + "".join(f"\nalso {f.text()}" for f in also))

    def __reduce__(self) -> tuple[object, ...]:
        # Picklable (a launcher sends it to the parent): rebuilt from its parts.
        return type(self), (self.failure, self.raised_on, self.prefix, self.also)


class RankUnresponsiveError(RankError, TimeoutError):
    """A rank stopped answering (died, froze) or a wait ran past its timeout."""


def describe(exc: BaseException) -> str:
    """``"Type: message"``, a failure's text; also for an exception whose ``str()`` raises
    (its peers must still hear of it: formatting it in the handler raised, unposted)."""
    try:
        text = str(exc)
    except Exception as inner:
        text = f"<str() of the exception raised {type(inner).__name__}>"
    return f"{type(exc).__name__}: {text}"


def error_for(
    failure: Failure, raised_on: int | None = None, prefix: str = "", also: Sequence[Failure] = ()
) -> RankError:
    """The exception for ``failure``: unresponsive ranks and timeouts are also TimeoutErrors."""
    cls = RankError if failure.kind == "error" else RankUnresponsiveError
    return cls(failure, raised_on, prefix, also)


# Shown in tracebacks and pickled under their public path, where they were defined before.
for _cls in (Failure, RankError, RankUnresponsiveError):
    _cls.__module__ = "xgrad.failure"
