"""PyTorch pipelining's CSV schedule format: one row per rank, one action text per cell."""

from __future__ import annotations

import csv
import io
import os
import warnings

from xgrad.pipeline.actions import Action, Kind, expand
from xgrad.pipeline.schedule import Schedule

__all__ = ["dump_csv", "load_csv", "schedule_from_csv", "schedule_to_csv"]


def schedule_to_csv(schedule: Schedule) -> str:
    """The CSV text ``torch.distributed.pipelining``'s ``_dump_csv`` writes for these actions
    (compute-only or with comms, as the schedule is).

    Warns:
        UserWarning: a schedule with sends and receives but no REDUCE_GRAD. torch's runtime
            takes such a file as complete, and only REDUCE_GRAD scales the gradients by 1/m
            (and reduces them across replicas), so it would give m times the gradients
            xgrad's runtime gives (torch's own ``_dump_csv`` always writes them): call
            :func:`~xgrad.pipeline.add_stage_ops` before :func:`~xgrad.pipeline.insert_comms`.

    Raises:
        ValueError: a schedule whose stages are not one chain (fairscale's invocations with
            skips): the format has no place for a stage's inputs, and the file would read
            back as a chain.
    """
    return _csv_text(schedule)


def _csv_text(schedule: Schedule) -> str:
    """:func:`schedule_to_csv`'s work (a warning names the line that called either writer)."""
    if not schedule.is_chain:
        first = next(
            s for s in range(schedule.num_stages) if schedule.sources(s) != ((s - 1,) if s else ())
        )
        raise ValueError(
            f"schedule {schedule.name!r} is not a chain (stage {first} takes the output of "
            f"stages {list(schedule.sources(first))}); torch's CSV format cannot say which "
            "stage feeds which, and it would read back as a chain"
        )
    flat = [a for acts in schedule.actions for a in acts]
    if schedule.has_comms and not any(a.kind is Kind.REDUCE_GRAD for a in flat):
        warnings.warn(
            f"schedule {schedule.name!r} has sends and receives but no REDUCE_GRAD: torch's "
            "runtime runs such a file as it is, and only REDUCE_GRAD scales the gradients "
            f"by 1/m (m = {schedule.num_microbatches}) and reduces them across "
            "data-parallel replicas, so its gradients would not be xgrad's runtime's; "
            "call add_stage_ops(...) before insert_comms(...), as torch's _dump_csv does",
            UserWarning,
            stacklevel=3,  # the line that called schedule_to_csv or dump_csv
        )
    buf = io.StringIO()
    writer = csv.writer(buf)
    for acts in schedule.actions:
        writer.writerow([str(a) for a in acts])
    return buf.getvalue()


#: missing stages a CSV error lists.
_LISTED = 10


def schedule_from_csv(
    text: str, *, placement: tuple[int, ...] | None = None, name: str = "csv"
) -> Schedule:
    """Read CSV text (as ``_load_csv`` does); empty cells (torch's idle steps) are skipped.

    Reads everything torch's ``_dump_csv`` writes, comms included: UNSHARD, RESHARD,
    REDUCE_GRAD and DualPipeV's ``(0F3;3B1)OVERLAP_F_B`` pairs.

    Args:
        text: rows of action texts, row r for rank r.
        placement: stage -> rank; by default found from where each stage's actions appear.
        name: the schedule's name.

    Raises:
        ValueError: a malformed cell (its rank and column named), or a stage found on two
            ranks, or a stage that never appears.
    """
    rows = list(csv.reader(io.StringIO(text)))
    actions: list[tuple[Action, ...]] = []
    for r, row in enumerate(rows):
        parsed: list[Action] = []
        for c, cell in enumerate(row):
            if not cell.strip():
                continue
            try:
                parsed.append(Action.parse(cell))
            except ValueError as exc:
                raise ValueError(f"CSV rank {r}, column {c}: {exc}") from None
        actions.append(tuple(parsed))
    everything = [a for acts in actions for a in expand(acts)]
    if not everything:
        raise ValueError("CSV holds no actions")
    if placement is None:
        owner: dict[int, int] = {}
        for r, rank_actions in enumerate(actions):
            for a in expand(rank_actions):
                if a.kind.is_compute and owner.setdefault(a.stage, r) != r:
                    raise ValueError(
                        f"CSV: stage {a.stage} has actions on ranks {owner[a.stage]} and {r}"
                    )
        n = max(a.stage for a in everything) + 1
        if len(owner) < n:
            # The first few missing (a typo'd stage number may be huge: not every one).
            missing: list[int] = []
            stage = 0
            while len(missing) < _LISTED and stage < n:
                if stage not in owner:
                    missing.append(stage)
                stage += 1
            more = (
                f" (and {n - len(owner) - len(missing)} more)" if n - len(owner) > _LISTED else ""
            )
            raise ValueError(
                f"CSV: stages {missing}{more} have no compute action, placement unknown "
                f"(the highest stage named is {n - 1})"
            )
        placement = tuple(owner[s] for s in range(n))
    m = max(a.microbatch for a in everything) + 1  # stage ops have none (-1)
    return Schedule(tuple(actions), tuple(placement), m, name)


def dump_csv(schedule: Schedule, path: str | os.PathLike[str]) -> None:
    """Write :func:`schedule_to_csv` to ``path`` (warns as it does)."""
    text = _csv_text(schedule)
    with open(path, "w", newline="") as f:
        f.write(text)


def load_csv(path: str | os.PathLike[str], *, placement: tuple[int, ...] | None = None) -> Schedule:
    """Read a schedule CSV file (see :func:`schedule_from_csv`)."""
    with open(path, newline="") as f:
        return schedule_from_csv(f.read(), placement=placement, name=os.path.basename(path))
