"""Pipeline actions: what one rank does at one step, with a short text form (``"1F0"``)."""

from __future__ import annotations

import enum
import re
from typing import NamedTuple

__all__ = ["Action", "Kind"]


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

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute


_COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})

# Longest alternatives first, so "SEND_F" is not read as stage + "S...".
_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class Action(NamedTuple):
    """One step of one rank: ``kind`` on virtual stage ``stage`` for microbatch ``microbatch``.

    The text form is ``f"{stage}{kind.value}{microbatch}"``, e.g. ``"1F0"`` (stage 1 runs the
    forward of microbatch 0) or ``"0SEND_B3"``; :meth:`parse` reads it back.

    Example:
        >>> Action.parse("2I5")
        Action(stage=2, kind=<Kind.BACKWARD_INPUT: 'I'>, microbatch=5)
        >>> str(Action(1, Kind.FORWARD, 0))
        '1F0'
    """

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the text form back; a malformed string is a ``ValueError`` that shows it."""
        if not isinstance(text, str):
            raise TypeError(f"action text must be a str, got {type(text).__name__}: {text!r}")
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(
                f"action text {text!r} is not STAGE KIND MICROBATCH (kinds F, B, I, W, "
                "SEND_F, RECV_F, SEND_B, RECV_B), e.g. '1F0'"
            )
        stage, kind, microbatch = match.groups()
        return cls(int(stage), Kind(kind), int(microbatch))
