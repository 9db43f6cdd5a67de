"""A module that reads the environment when it is imported, for the launcher's tests: a
rank imports it while unpickling its function, so what it read shows which environment
the rank had by then."""

from __future__ import annotations

import os

AT_IMPORT = os.environ.get("XGRAD_LAUNCH_TEST")


def seen(rank: int, world_size: int) -> tuple[str | None, str | None, str | None]:
    """What this rank's process read at import, reads now, and whether a removed one is gone."""
    return AT_IMPORT, os.environ.get("XGRAD_LAUNCH_TEST"), os.environ.get("XGRAD_LAUNCH_GONE")
