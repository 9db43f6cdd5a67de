"""Pipeline actions: what one rank does at one step, with a short text form (``"1F0"``)."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

__all__ = ["NO_MICROBATCH", "Action", "Kind", "expand"]

#: The microbatch of a stage-level action (UNSHARD, RESHARD, REDUCE_GRAD), which has none.
NO_MICROBATCH = -1


class Kind(str, enum.Enum):
    """What an action does; the value is its text form (the same letters as PyTorch's)."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: gradients for the inputs and the weights
    BACKWARD_INPUT = "I"  # zero-bubble split: gradient for the stage's input only
    BACKWARD_WEIGHT = "W"  # zero-bubble split: gradient for the stage's weights only
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    # Stage-level actions of torch's lowering passes (no microbatch): gather a sharded
    # (FSDP) stage's weights before its first pass, free them after its last, and reduce its
    # gradients across data-parallel replicas after its last backward.
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    # DualPipeV: a forward and a backward of two stages of the rank issued together, so the
    # one's compute hides the other's communication; ``Action.sub`` holds the pair.
    OVERLAP_F_B = "OVERLAP_F_B"

    @property
    def is_compute(self) -> bool:
        """A pass of a stage on a microbatch (F, B, I, W, or an overlapped F/B pair)."""
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        """A point-to-point send or receive."""
        return self in _COMM

    @property
    def is_stage_op(self) -> bool:
        """UNSHARD, RESHARD or REDUCE_GRAD: about a whole stage, not a microbatch."""
        return self in _STAGE


_COMPUTE = frozenset(
    {Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT, Kind.OVERLAP_F_B}
)
_COMM = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
_STAGE = frozenset({Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD})

# Longest alternatives first, so "SEND_F" is not read as stage + "S...".
_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_STAGE_PATTERN = re.compile(r"^(\d+)(UNSHARD|RESHARD|REDUCE_GRAD)$")
_OVERLAP_PATTERN = re.compile(r"^\((.*)\)OVERLAP_F_B$")


class Action(NamedTuple):
    """One step of one rank: ``kind`` on virtual stage ``stage`` for microbatch ``microbatch``.

    The text form is ``f"{stage}{kind.value}{microbatch}"``, e.g. ``"1F0"`` (stage 1 runs the
    forward of microbatch 0) or ``"0SEND_B3"``; stage-level actions have no microbatch
    (``"0UNSHARD"``, microbatch :data:`NO_MICROBATCH`), and an overlapped pair is written as
    torch writes it, ``"(0F3;3B1)OVERLAP_F_B"`` (its stage and microbatch are those of its
    first sub-action). :meth:`parse` reads every form back.

    Example:
        >>> Action.parse("2I5")
        Action(stage=2, kind=<Kind.BACKWARD_INPUT: 'I'>, microbatch=5, sub=())
        >>> str(Action(1, Kind.FORWARD, 0))
        '1F0'
        >>> str(Action.overlap(Action.parse("0F3"), Action.parse("3B1")))
        '(0F3;3B1)OVERLAP_F_B'
    """

    stage: int
    kind: Kind
    microbatch: int
    sub: tuple[Action, ...] = ()

    def __str__(self) -> str:
        if self.kind is Kind.OVERLAP_F_B:
            return f"({';'.join(str(a) for a in self.sub)}){self.kind.value}"
        if self.kind.is_stage_op:
            return f"{self.stage}{self.kind.value}"
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def stage_op(cls, stage: int, kind: Kind) -> Action:
        """An UNSHARD, RESHARD or REDUCE_GRAD of ``stage``."""
        if not kind.is_stage_op:
            raise ValueError(f"kind must be UNSHARD, RESHARD or REDUCE_GRAD, got {kind.name}")
        return cls(stage, kind, NO_MICROBATCH)

    @classmethod
    def overlap(cls, forward: Action, backward: Action) -> Action:
        """DualPipeV's overlapped pair: ``forward`` (F) and ``backward`` (B or I), run together."""
        if forward.kind is not Kind.FORWARD or backward.kind not in (
            Kind.BACKWARD,
            Kind.BACKWARD_INPUT,
        ):
            raise ValueError(
                f"an overlapped pair is a forward and a backward, got {forward} and {backward}"
            )
        return cls(forward.stage, Kind.OVERLAP_F_B, forward.microbatch, (forward, backward))

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the text form back; a malformed string is a ``ValueError`` that shows it."""
        if not isinstance(text, str):
            raise TypeError(f"action text must be a str, got {type(text).__name__}: {text!r}")
        stripped = text.strip()
        overlap = _OVERLAP_PATTERN.match(stripped)
        if overlap is not None:
            parts = [p for p in overlap.group(1).split(";") if p.strip()]
            if len(parts) != 2:
                raise ValueError(
                    f"action text {text!r}: an overlapped pair holds two actions, "
                    f"e.g. '(0F3;3B1)OVERLAP_F_B'"
                )
            return cls.overlap(cls.parse(parts[0]), cls.parse(parts[1]))
        staged = _STAGE_PATTERN.match(stripped)
        if staged is not None:
            return cls.stage_op(int(staged.group(1)), Kind(staged.group(2)))
        match = _PATTERN.match(stripped)
        if match is None:
            raise ValueError(
                f"action text {text!r} is not STAGE KIND MICROBATCH (kinds F, B, I, W, "
                "SEND_F, RECV_F, SEND_B, RECV_B), STAGE KIND (UNSHARD, RESHARD, REDUCE_GRAD) "
                "or (A;B)OVERLAP_F_B, e.g. '1F0'"
            )
        stage, kind, microbatch = match.groups()
        return cls(int(stage), Kind(kind), int(microbatch))


def expand(actions: Iterable[Action]) -> Iterator[Action]:
    """The actions with each overlapped pair replaced by its two sub-actions, in order (how
    one thread runs them, and how validation and the simulator see them)."""
    for a in actions:
        if a.kind is Kind.OVERLAP_F_B:
            yield from a.sub
        else:
            yield a
