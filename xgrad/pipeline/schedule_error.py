"""The error of a schedule that cannot run: the rank × step grid, the failing step marked.

Its own module because every check raises it: :mod:`xgrad.pipeline.validate` (which
re-exports it) and the lock-step run of :mod:`xgrad.pipeline.lockstep` below it.
"""

from __future__ import annotations

from xgrad.pipeline.schedule import Schedule

__all__ = ["ScheduleError"]


class ScheduleError(ValueError):
    """A schedule that cannot run; the message ends with the grid, the failing step marked.

    Attributes:
        rank: the rank at fault (the first stuck one for a deadlock).
        step: the index of the failing action in that rank's list.
    """

    def __init__(self, schedule: Schedule, rank: int, step: int, reason: str) -> None:
        self.rank = rank
        self.step = step
        self.reason = reason
        grid = schedule.grid(mark=step, note=f"rank {rank}: {reason}")
        super().__init__(
            f"schedule {schedule.name!r} is invalid at rank {rank}, step {step}: {reason}\n{grid}"
        )
