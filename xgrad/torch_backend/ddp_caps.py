"""DDP's bucket caps read as PyTorch 2.13 reads them: MiB to bytes, negative caps, the list.

PyTorch's DDP converts a cap with ``int(mb * 2**20)`` and hands the result, unchecked, to
two places that disagree about negative numbers::

    bucket_cap_mb=-1 -> -1048576 bytes
      initial assignment  _compute_bucket_assignment_by_size(limits: size_t)  TypeError
                          (reached only with find_unused_parameters and no static graph;
                          otherwise the first plan is one bucket, sys.maxsize)
      rebuild             C++ Reducer(int64 caps) -> size_t: 2**64 - 1048576  no cap

so a negative ``bucket_cap_mb`` means "no cap" (the first bucket's 1 MiB cap included,
since an explicit cap replaces it) wherever PyTorch accepts it, and a negative entry of
``bucket_cap_mb_list`` (used for the initial assignment too) is always refused. The
conversion's own failures keep PyTorch's exception types: ``"a"`` is a ``ValueError``
(``int("aaa…")``), ``None`` a ``TypeError``, ``inf`` an ``OverflowError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from xgrad.buckets import NO_LIMIT, cap_mb_to_bytes
from xgrad.ddp_setup import DDPLimits

__all__ = ["Caps", "resolve_caps", "torch_cap_bytes"]

_MIB = 1024 * 1024


def torch_cap_bytes(value: object, name: str) -> int:
    """``int(value * 2**20)`` as PyTorch's DDP computes it, failing with its exception type.

    A bool is a number here (``True`` is 1 MiB), as it is to PyTorch; a tiny positive cap
    truncates to 0 bytes (a bucket per parameter), as PyTorch's does.

    Raises:
        ValueError: text (PyTorch repeats it 2**20 times and ``int()`` refuses that),
            or ``nan``.
        OverflowError: an infinite cap.
        TypeError: anything else that is not a number (``None``, a list).
    """
    if isinstance(value, (str, bytes, bytearray)):
        raise ValueError(f"{name} = {value!r:.60}: expected a bucket cap in MiB, not text")
    if isinstance(value, (list, tuple, dict, set)):  # not built 2**20 times over to fail
        raise TypeError(f"{name} = {value!r:.60}: expected a bucket cap in MiB")
    try:
        return int(value * _MIB)  # type: ignore[operator, call-overload]
    except (OverflowError, ValueError, TypeError) as err:
        kind = next(k for k in (OverflowError, ValueError, TypeError) if isinstance(err, k))
        raise kind(f"{name} = {value!r:.60}: expected a finite bucket cap in MiB ({err})") from None


@dataclass(frozen=True)
class Caps:
    """The caps in bytes, as xgrad's planner takes them and as PyTorch's attributes show them.

    Attributes:
        cap: the bucket cap for the planner (``None``: DDP's default; :data:`NO_LIMIT`
            for a negative ``bucket_cap_mb``).
        first: the first bucket's cap for the planner (``None``: DDP's rule).
        cap_list: ``bucket_cap_mb_list`` in bytes (``None`` when absent or empty).
        negative: a negative ``bucket_cap_mb`` in bytes, which PyTorch's
            ``bucket_bytes_cap`` attribute keeps (``None`` otherwise).
    """

    cap: int | None
    first: int | None
    cap_list: list[int] | None
    negative: int | None = None

    def limits(self, *, find_unused_parameters: bool, static_graph: bool) -> DDPLimits:
        """The planner's limits for these caps (DDP's construction, and the tests that
        compare its outcome with PyTorch's)."""
        return DDPLimits.of(
            bucket_cap_bytes=self.cap,
            first_bucket_cap_bytes=self.first,
            bucket_cap_bytes_list=self.cap_list,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
        )

    def attribute(self, largest: int) -> int:
        """PyTorch's ``bucket_bytes_cap`` given the planner's largest cap."""
        return largest if self.negative is None else self.negative


def resolve_caps(
    bucket_cap_mb: object,
    first_bucket_cap_mb: object,
    bucket_cap_mb_list: Sequence[object] | None,
    *,
    find_unused_parameters: bool,
    static_graph: bool,
) -> Caps:
    """The caps PyTorch's DDP derives from its arguments (see the module docstring).

    A non-empty ``bucket_cap_mb_list`` wins and ``bucket_cap_mb`` is not read at all, as
    in PyTorch. With neither cap given the first bucket's is ``torch.distributed``'s
    ``_DEFAULT_FIRST_BUCKET_BYTES`` as it is now, read at construction as PyTorch's DDP
    does: scripts (and PyTorch's own tests) lower it to get several buckets, and a
    different first bucket changes the layout, hence gloo's summation order from world
    size 3 on. ``first_bucket_cap_mb`` is xgrad's and refuses what is not a cap >= 0.

    Raises:
        TypeError: a negative list entry, or a negative ``bucket_cap_mb`` with
            ``find_unused_parameters`` and no static graph (where PyTorch's bucket
            assignment refuses it); and see :func:`torch_cap_bytes`.
    """
    first = (
        None
        if first_bucket_cap_mb is None
        else cap_mb_to_bytes(first_bucket_cap_mb, "first_bucket_cap_mb")
    )
    if bucket_cap_mb_list:  # PyTorch's: an empty list is no list
        caps = []
        for i, mb in enumerate(bucket_cap_mb_list):
            c = torch_cap_bytes(mb, f"bucket_cap_mb_list[{i}]")
            if c < 0:
                raise TypeError(
                    f"bucket_cap_mb_list[{i}] = {mb!r} is {c} bytes: "
                    "PyTorch's bucket assignment takes only caps >= 0"
                )
            caps.append(c)
        return Caps(None, first, caps)
    if bucket_cap_mb is None:
        return Caps(None, int(dist._DEFAULT_FIRST_BUCKET_BYTES) if first is None else first, None)
    cap = torch_cap_bytes(bucket_cap_mb, "bucket_cap_mb")
    if cap >= 0:
        return Caps(cap, first, None)
    if find_unused_parameters and not static_graph:
        raise TypeError(
            f"bucket_cap_mb = {bucket_cap_mb!r} is {cap} bytes: with "
            "find_unused_parameters=True PyTorch's bucket assignment takes only caps >= 0 "
            "(a negative cap means no cap only where DDP starts with one bucket)"
        )
    return Caps(NO_LIMIT, first, None, negative=cap)
