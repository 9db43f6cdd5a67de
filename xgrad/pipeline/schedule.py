"""A schedule: one tuple of actions per rank, the stage placement, and a text grid of it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from xgrad.pipeline.actions import Action, Kind, expand

__all__ = ["Schedule", "format_grid"]


def format_grid(
    columns: Sequence[Sequence[str]],
    *,
    row_label: str = "step",
    column_label: str = "rank",
    mark: int | None = None,
    note: str = "",
) -> str:
    """Draw columns of cells (one column per rank) as rows of steps, marking row ``mark``.

    Args:
        columns: the cells of each column, top to bottom; shorter columns are padded blank.
        row_label: word printed before each row number.
        column_label: word printed above each column number.
        mark: a row to point at (an error's step), or ``None``.
        note: text after the marker arrow.
    """
    rows = max((len(c) for c in columns), default=0)
    digits = len(str(max(rows - 1, 0)))
    labels = [f"{row_label} {i:0{digits}d}" for i in range(rows)]
    heads = [f"{column_label} {r}" for r in range(len(columns))]
    widths = [
        max([len(h), *(len(cell) for cell in col)]) for h, col in zip(heads, columns, strict=True)
    ]
    pad = len(labels[0]) if labels else len(row_label)
    lines = [" " * (pad + 2) + "  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True))]
    for i, label in enumerate(labels):
        cells = [
            (col[i] if i < len(col) else "").ljust(w)
            for col, w in zip(columns, widths, strict=True)
        ]
        line = f"{label}: " + "  ".join(cells)
        if i == mark:
            line = line.rstrip() + "  <-- " + (note or "here")
        lines.append(line.rstrip())
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Schedule:
    """What every rank does, in order: plain data, printable, comparable and hashable.

    Index letters: p ranks (``num_ranks``), s virtual stages (``num_stages``; s = p·v with v
    chunks per rank), m microbatches (``num_microbatches``).

    Attributes:
        actions: ``actions[r]`` is rank r's actions in execution order.
        placement: ``placement[s]`` is the rank that runs virtual stage s (stage s's output
            feeds stage s + 1; see :mod:`xgrad.pipeline.invocation` for how a model maps here).
        num_microbatches: m.
        name: the generator that made it (for printing).
        inputs: for a DAG of stages (fairscale's invocations with skip connections),
            ``inputs[s]`` is the stages whose outputs stage s takes, in order (stage s is
            called with their tuple when there are several); empty (the default) is the
            chain, stage s taking stage s - 1's output. The last stage ends the model.
    """

    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...]
    num_microbatches: int
    name: str = "custom"
    inputs: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise ValueError(
                f"num_microbatches must be a positive int, got {self.num_microbatches!r}"
            )
        if not self.placement:
            raise ValueError("placement must name the rank of at least one stage, got ()")
        p = len(self.actions)
        for s, r in enumerate(self.placement):
            if not isinstance(r, int) or not 0 <= r < p:
                raise ValueError(f"placement[{s}] = {r!r} is not a rank in 0..{p - 1}")
        if self.inputs:
            self._check_inputs()
        for r, acts in enumerate(self.actions):
            for i, top in enumerate(acts):
                if not isinstance(top, Action):
                    raise TypeError(f"rank {r} step {i}: expected an Action, got {top!r}")
                for a in expand([top]):
                    self._check_action(r, i, a)

    def _check_inputs(self) -> None:
        n = len(self.placement)
        if len(self.inputs) != n:
            raise ValueError(f"inputs has {len(self.inputs)} entries for {n} stages")
        if self.inputs[0]:
            raise ValueError(f"stage 0 reads the model input; inputs[0] = {self.inputs[0]}")
        for t in range(1, n):
            ins = self.inputs[t]
            if not ins or len(set(ins)) != len(ins) or not all(0 <= s < t for s in ins):
                raise ValueError(
                    f"inputs[{t}] = {ins} must be distinct earlier stages 0..{t - 1}, at least one"
                )
        used = {s for ins in self.inputs for s in ins}
        unused = [s for s in range(n - 1) if s not in used]
        if unused:
            raise ValueError(
                f"stages {unused} feed no later stage; only stage {n - 1} ends the model"
            )

    @cached_property
    def _sources(self) -> tuple[tuple[int, ...], ...]:
        if self.inputs:
            return self.inputs
        return tuple((s - 1,) if s else () for s in range(len(self.placement)))

    @cached_property
    def _consumers(self) -> tuple[tuple[int, ...], ...]:
        users: list[list[int]] = [[] for _ in self.placement]
        for t, ins in enumerate(self._sources):
            for s in ins:
                users[s].append(t)
        return tuple(tuple(u) for u in users)

    def sources(self, stage: int) -> tuple[int, ...]:
        """The stages whose outputs ``stage`` takes (``()`` for stage 0)."""
        return self._sources[stage]

    def consumers(self, stage: int) -> tuple[int, ...]:
        """The stages that take ``stage``'s output (``()`` for the last)."""
        return self._consumers[stage]

    @property
    def is_chain(self) -> bool:
        """Whether each stage takes exactly the previous one's output."""
        return all(ins == ((s - 1,) if s else ()) for s, ins in enumerate(self._sources))

    def _check_action(self, r: int, i: int, a: Action) -> None:
        if not 0 <= a.stage < len(self.placement):
            raise ValueError(
                f"rank {r} step {i}: action {a} names stage {a.stage}, "
                f"stages are 0..{len(self.placement) - 1}"
            )
        if not a.kind.is_stage_op and not 0 <= a.microbatch < self.num_microbatches:
            raise ValueError(
                f"rank {r} step {i}: action {a} names microbatch {a.microbatch}, "
                f"microbatches are 0..{self.num_microbatches - 1}"
            )

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def has_comms(self) -> bool:
        """Whether sends and receives are explicit (after :func:`~xgrad.pipeline.insert_comms`)."""
        return any(a.kind.is_comm for acts in self.actions for a in acts)

    @property
    def splits_backward(self) -> bool:
        """Whether any backward is split into input (I) and weight (W) parts (zero-bubble)."""
        return bool(self._split_pairs)

    @cached_property
    def _split_pairs(self) -> frozenset[tuple[int, int]]:
        return frozenset(
            (a.stage, a.microbatch)
            for acts in self.actions
            for a in expand(acts)
            if a.kind is Kind.BACKWARD_INPUT
        )

    def backward_kind(self, stage: int, microbatch: int) -> Kind:
        """The pass that computes (stage, microbatch)'s input gradient: I where its backward is
        split, else B (DualPipeV mixes both in one schedule)."""
        return Kind.BACKWARD_INPUT if (stage, microbatch) in self._split_pairs else Kind.BACKWARD

    def compute(self, rank: int) -> tuple[Action, ...]:
        """Rank ``rank``'s passes in order, overlapped pairs expanded, no comms or stage ops."""
        return tuple(a for a in expand(self.actions[rank]) if a.kind.is_compute)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages placed on ``rank``, in stage order."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def text(self) -> str:
        """Canonical text: placement, microbatches, then each rank's actions (what
        :meth:`digest` hashes; two ranks with the same text run the same schedule)."""
        rows = [" ".join(str(a) for a in acts) for acts in self.actions]
        head = (
            f"placement {','.join(map(str, self.placement))} microbatches {self.num_microbatches}"
        )
        if not self.is_chain:
            head += " inputs " + ";".join(",".join(map(str, ins)) for ins in self._sources)
        return "\n".join([head, *(f"rank {r}: {row}" for r, row in enumerate(rows))]) + "\n"

    def digest(self) -> str:
        """SHA-256 of :meth:`text`: equal on every rank before a runtime's first step."""
        return hashlib.sha256(self.text().encode()).hexdigest()

    def grid(self, *, mark: int | None = None, note: str = "") -> str:
        """The rank × step grid (a column per rank), optionally pointing at step ``mark``.

        A row is a position in each rank's own list (rank r's k-th action), not a moment in
        time: ranks wait for each other between rows. :func:`~xgrad.pipeline.simulate`'s
        grid is the timeline.
        """
        columns = [[str(a) for a in acts] for acts in self.actions]
        body = format_grid(columns, mark=mark, note=note)
        return "(step = position in each rank's own order, not time)\n" + body

    def __str__(self) -> str:
        return self.grid()
