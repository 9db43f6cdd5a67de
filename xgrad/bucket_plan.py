"""A bucket plan as frozen data: checked when made, compared, hashed, saved and printed.

Kept apart from :mod:`xgrad.buckets`, which computes plans (PyTorch's assignment, DDP's
first plan and its rebuild) and re-exports :class:`BucketPlan` and :data:`NO_LIMIT`:
every backend, the crosscheck and the commands hold plans, while few compute one, and
what a plan is (its invariants, its JSON, its digest, its table) reads on its own.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

__all__ = ["NO_LIMIT", "BucketPlan"]

#: What PyTorch's DDP uses for its first, unbucketed iteration (one bucket for all).
NO_LIMIT = sys.maxsize


@dataclass(frozen=True)
class BucketPlan:
    """Parameter indices per bucket, in launch order, and the cap each was filled to.

    Attributes:
        buckets: one tuple of parameter indices per bucket; bucket ``b`` is launched
            before bucket ``b + 1`` on every rank.
        limits: the byte cap bucket ``b`` was filled to (0 for a sparse gradient's own
            bucket, which has no cap).

    Example:
        >>> from xgrad.buckets import assign_buckets
        >>> plan = assign_buckets([400, 400, 400], [800])
        >>> plan.buckets
        ((0, 1), (2,))
        >>> BucketPlan.from_json(plan.to_json()) == plan
        True
    """

    buckets: tuple[tuple[int, ...], ...]
    limits: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.buckets:
            raise ValueError("BucketPlan has no buckets: a plan needs at least one")
        if len(self.buckets) != len(self.limits):
            raise ValueError(
                f"BucketPlan needs one limit per bucket: got {len(self.buckets)} buckets "
                f"and {len(self.limits)} limits"
            )
        for b, limit in enumerate(self.limits):
            # 0 is the "no cap" of a sparse gradient's own bucket; below that is nonsense.
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(
                    f"BucketPlan limit of bucket {b} is {limit!r}: expected a byte cap >= 0"
                )
        seen: set[int] = set()
        for b, bucket in enumerate(self.buckets):
            if not bucket:
                raise ValueError(f"BucketPlan bucket {b} is empty")
            for index in bucket:
                if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                    raise ValueError(f"BucketPlan bucket {b} holds {index!r}, not an index >= 0")
                if index in seen:
                    raise ValueError(f"BucketPlan: parameter {index} is in more than one bucket")
                seen.add(index)
        if seen != set(range(len(seen))):
            missing = sorted(set(range(max(seen) + 1)) - seen)
            raise ValueError(f"BucketPlan leaves parameters {missing} in no bucket")

    @property
    def num_params(self) -> int:
        return sum(len(b) for b in self.buckets)

    @cached_property
    def _positions(self) -> dict[int, tuple[int, int]]:
        return {i: (b, k) for b, bucket in enumerate(self.buckets) for k, i in enumerate(bucket)}

    def bucket_of(self) -> dict[int, tuple[int, int]]:
        """Map each parameter index to ``(bucket, position within the bucket)``."""
        return dict(self._positions)

    def to_dict(self) -> dict[str, list[list[int]] | list[int]]:
        return {"buckets": [list(b) for b in self.buckets], "limits": list(self.limits)}

    def to_json(self) -> str:
        """Canonical JSON: the same plan always gives the same text (and digest)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BucketPlan:
        """The plan :meth:`to_json` wrote; anything else is refused, never coerced.

        Raises:
            TypeError: ``text`` is not a string.
            ValueError: not JSON, not an object with exactly ``buckets`` and ``limits``,
                a non-integer index or limit (``1.7`` is not rounded), a negative one, or
                an empty plan; the message shows the value.
        """
        if not isinstance(text, (str, bytes, bytearray)):
            raise TypeError(f"BucketPlan.from_json takes JSON text, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"BucketPlan.from_json: not JSON ({err}): {text[:80]!r}") from None
        if not isinstance(data, dict) or set(data) != {"buckets", "limits"}:
            raise ValueError(f"not a BucketPlan JSON object: {text[:80]!r}")
        buckets, limits = data["buckets"], data["limits"]
        if not isinstance(buckets, list) or not all(isinstance(b, list) for b in buckets):
            raise ValueError(f"BucketPlan JSON: buckets must be a list of lists, got {buckets!r}")
        if not isinstance(limits, list):
            raise ValueError(f"BucketPlan JSON: limits must be a list, got {limits!r}")
        # Tuples as they came: __post_init__ refuses floats, negatives, bools and gaps.
        return cls(buckets=tuple(tuple(b) for b in buckets), limits=tuple(limits))

    def digest(self) -> str:
        """A stable SHA-256 of the canonical JSON, so ranks can compare plans cheaply."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def reversed(self) -> BucketPlan:
        """The same buckets launched in the opposite order (how DDP uses its first plan)."""
        return BucketPlan(tuple(reversed(self.buckets)), tuple(reversed(self.limits)))

    def table(self, nbytes: Sequence[int] | None = None, names: Sequence[str] | None = None) -> str:
        """A plain-text table of the plan, one row per bucket.

        The limit of a bucket without a cap (DDP's first iteration, :data:`NO_LIMIT`) shows
        as ``∞``; that of a sparse gradient's own bucket as ``none``.
        """
        rows = [("bucket", "params", "bytes", "limit", "members")]
        for b, (bucket, limit) in enumerate(zip(self.buckets, self.limits, strict=True)):
            size = "-" if nbytes is None else str(sum(nbytes[i] for i in bucket))
            members = [names[i] if names is not None else str(i) for i in bucket]
            shown = ", ".join(members[:6]) + (
                f", ... (+{len(members) - 6})" if len(members) > 6 else ""
            )
            cap = "∞" if limit >= NO_LIMIT else str(limit) if limit else "none"
            rows.append((str(b), str(len(bucket)), size, cap, shown))
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        return "\n".join(
            "  ".join(r[c].rjust(widths[c]) for c in range(4)) + "  " + r[4] for r in rows
        )
