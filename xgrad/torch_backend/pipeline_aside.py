"""Failed pipeline steps, set aside until no peer can still need their poison.

A failed step leaves transfers that gloo cannot cancel (receives posted ahead, sends
never taken), so its private groups are not reused: the next step makes fresh ones, and
the failed step's are aborted once every rank started a later step on the same pipeline
group (each has then left the failed step) or a rank of it is known lost.

The step's transfers in flight are kept with its groups (its wire's sends and posted
receives, not its activations: those hold the stages' graphs, and a DDP inside a stage
through them). Its poison sends stay pending until the peer posts the matching receive,
and a gloo send whose work is freed before then is dropped without a word: a peer still
computing when this rank failed then waited its whole timeout for a message that never
came, and failed its next step on this rank's timeout. The runtime held the wire, so a
loop that made a fresh ``PipelineRuntime`` after a failed step (a retry, a notebook cell
run again) freed them with the old runtime. Kept here, per pipeline group, a later step
of any runtime on that group releases them.
"""

from __future__ import annotations

import atexit
import contextlib
from typing import Any, NamedTuple

from xgrad.torch_backend.pipeline_wire import retire

__all__ = ["abort_set_aside", "set_aside", "set_aside_count"]


class _Aside(NamedTuple):
    pipeline: str  # the pipeline group's name (its steps are numbered per group)
    step: int  # the failed step's number on that group
    groups: tuple[Any, ...]  # its private groups
    transfers: Any  # its transfers in flight, (work, buffers) each; None if it had none


_set_aside: list[_Aside] = []


def set_aside(pipeline: str, step: int, groups: tuple[Any, ...], transfers: Any) -> None:
    """Keep failed step ``step`` of pipeline group ``pipeline`` (its private ``groups``
    and ``transfers`` in flight) until :func:`abort_set_aside` (or exit)."""
    _set_aside.append(_Aside(pipeline, step, tuple(groups), transfers))


def abort_set_aside(pipeline: str, *, before: int | None = None, step: int | None = None) -> int:
    """Abort the failed steps of ``pipeline`` set aside: every one numbered below
    ``before`` (every rank started step ``before``), or step ``step`` alone. Returns how
    many were aborted."""
    kept: list[_Aside] = []
    gone: list[_Aside] = []
    for entry in _set_aside:
        match = entry.pipeline == pipeline and (
            (before is not None and entry.step < before) or entry.step == step
        )
        (gone if match else kept).append(entry)
    _set_aside[:] = kept
    for entry in gone:
        for group in entry.groups:
            retire(group)  # the name stays taken; the transfers go with the entry
    return len(gone)


def set_aside_count(pipeline: str | None = None) -> int:
    """How many failed steps are set aside (of ``pipeline``, or of every group)."""
    return sum(1 for e in _set_aside if pipeline is None or e.pipeline == pipeline)


@atexit.register
def _abort_all() -> None:
    for entry in _set_aside:
        for group in entry.groups:
            with contextlib.suppress(Exception):
                retire(group)
    _set_aside.clear()
