"""``xgrad bench faults``: the fault matrix, on xgrad's DDP, the pipeline runtime and the reference.

Per cell (system × fault × where × world size) one fresh group of processes runs
:func:`~xgrad.torch_backend.faults_cells.run_cell`: rank 1 raises (and stays alive), is
killed or freezes; the table says whether every other rank raised, whether the error
names rank 1, the slowest rank's time to the error, whether every surviving process
exited by itself (``destroy_process_group()`` returned), and whether the next step gave
the clean step's gradients (or, with rank 1 gone, raised the same named error at once).
The reference backend's ranks are threads of one process: its cells raise only.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from xgrad.help_format import QuickDefault
from xgrad.tables import Table, add_table_outputs, print_tables
from xgrad.torch_backend.faults_cells import FAULTY, HEARTBEAT_ENV, named_origin, run_cell
from xgrad.torch_backend.gather import OK, gather_ranks

HELP = "the fault matrix: raise, kill and freeze a rank of the DDP, the pipeline, the reference"

#: (system, fault, where) rows; each runs at every world size asked for.
CELLS: tuple[tuple[str, str, str], ...] = (
    ("ddp", "raise", "forward"),
    ("ddp", "raise", "backward hook"),
    ("ddp", "raise", "before DDP"),
    ("ddp", "raise", "comm hook"),
    ("ddp", "kill", "comm hook"),
    ("ddp", "freeze", "forward"),
    ("pipeline", "raise", "forward"),
    ("pipeline", "kill", "forward"),
    ("pipeline", "freeze", "forward"),
    ("reference", "raise", "comm hook"),
)
QUICK_CELLS = (
    ("ddp", "raise", "comm hook"),
    ("ddp", "kill", "comm hook"),
    ("pipeline", "raise", "forward"),
    ("reference", "raise", "comm hook"),
)

COLUMNS = ("every rank raised", "origin named", "time to error s", "exited", "next step ok")


def _launch(world: int, cell: tuple[Any, ...], limit: float) -> tuple[dict[int, dict], dict]:
    """Run one cell on ``world`` processes; per-rank reports and exit codes (None: killed here)."""
    survivors = [r for r in range(world) if r != FAULTY]
    results, codes = gather_ranks(
        run_cell, world, cell, limit=limit, wait_for=survivors, env=HEARTBEAT_ENV
    )
    reports = {
        r: value if status == OK else {"crash": value} for r, (status, value) in results.items()
    }
    return reports, codes


def _verdict(ok: bool) -> str:
    return "yes" if ok else "no"


def torch_cell(system: str, fault: str, where: str, world: int, timeout: float) -> dict:
    """One row of the table for a multi-process cell."""
    reports, codes = _launch(world, (system, fault, where, timeout), limit=timeout * 3 + 60)
    raising = [r for r in range(world) if r != FAULTY or fault == "raise"]
    seen = [reports.get(r, {}) for r in raising]
    crashed = [r.get("crash", "") for r in seen if "crash" in r]
    survivors = [r for r in range(world) if r != FAULTY]
    # The failing rank raises its own error; the others must name it.
    peers = [reports.get(r, {}) for r in survivors]
    return {
        "system": system,
        "fault": fault,
        "where": where,
        "world": world,
        "every rank raised": _verdict(all(s.get("error") for s in seen)),
        "origin named": _verdict(all(s.get("origin") == FAULTY for s in peers)),
        "time to error s": max((s.get("seconds", float("nan")) for s in seen), default=0.0),
        "exited": _verdict(all(codes.get(r) == 0 for r in survivors)),
        "next step ok": _verdict(all(s.get("next") for s in seen)),
        "errors": [s.get("error", "") for s in seen] + crashed,
    }


def reference_cell(world: int) -> dict:
    """The reference backend: rank 1's hook raises; every simulated rank's error, then a clean run."""
    import numpy as np

    from xgrad.hooks import allreduce_hook
    from xgrad.reference.comm import ReferenceComm, spawn

    def body(fail: bool) -> Any:
        def rank_main(comm: ReferenceComm) -> Any:
            hook = allreduce_hook(comm)

            def faulty(bucket: Any) -> Any:
                if fail and comm.rank == FAULTY:
                    raise RuntimeError("injected fault in comm hook")
                return hook(bucket)

            try:
                buffer = np.full(4, float(comm.rank + 1))
                return faulty(_Bucket(buffer)).wait()
            except Exception as exc:
                comm.world.abort(comm.rank, f"{type(exc).__name__}: {exc}")  # first one wins
                return exc

        return rank_main

    start = time.monotonic()
    results = spawn(body(True), world, timeout=30)
    seconds = time.monotonic() - start
    errors = [r for r in results if isinstance(r, Exception)]
    clean = spawn(body(False), world, timeout=30)
    total = sum(range(1, world + 1)) / world
    return {
        "system": "reference",
        "fault": "raise",
        "where": "comm hook",
        "world": world,
        "every rank raised": _verdict(len(errors) == world),
        "origin named": _verdict(
            all(named_origin(str(e), e) == FAULTY for r, e in enumerate(results) if r != FAULTY)
        ),
        "time to error s": seconds,
        "exited": "yes",  # threads, all joined
        "next step ok": _verdict(all(np.allclose(c, total) for c in clean)),
        "errors": [str(e) for e in errors],
    }


class _Bucket:
    """The least of a GradBucket the core hooks need."""

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer

    def buffer(self) -> Any:
        return self._buffer

    def index(self) -> int:
        return 0


def run_matrix(
    cells: Sequence[tuple[str, str, str]], worlds: Sequence[int], timeout: float
) -> list[dict]:
    rows = []
    for system, fault, where in cells:
        for world in worlds:
            if system == "reference":
                rows.append(reference_cell(world))
            else:
                rows.append(torch_cell(system, fault, where, world, timeout))
    return rows


def rows_table(rows: Sequence[dict]) -> Table:
    """The matrix as data (for ``--json``/``--csv``), every rank's error text included."""
    head = ("system", "fault", "where", "world", *COLUMNS)
    cells = [(*(row[h] for h in head), "\n".join(row["errors"])) for row in rows]
    return Table((*head, "errors"), tuple(cells), "bench faults")


def table(rows: Sequence[dict]) -> str:
    """The matrix as a Markdown table (the README shows it)."""
    head = ("system", "fault", "where", "world", *COLUMNS)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row[h]) if h != "time to error s" else f"{row[h]:.2f}" for h in head]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a few cells at world size 2")
    parser.add_argument(
        "--worlds", type=int, nargs="+", default=QuickDefault([2, 3], [2]), help="world sizes"
    )
    parser.add_argument(
        "--timeout", type=float, default=8.0, help="the DDP's and pipeline's timeout="
    )
    parser.add_argument("--errors", action="store_true", help="also print every rank's error")
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=sorted({c[0] for c in CELLS}),
        default=None,
        help="only the cells of these systems (default: all)",
    )
    parser.add_argument(
        "--faults",
        nargs="+",
        choices=sorted({c[1] for c in CELLS}),
        default=None,
        help="only the cells of these faults (default: all)",
    )
    add_table_outputs(parser, "the matrix (every rank's error included)")


def run(args: argparse.Namespace) -> int:
    cells = QUICK_CELLS if args.quick else CELLS
    systems, faults = getattr(args, "systems", None), getattr(args, "faults", None)
    cells = tuple(
        c for c in cells if (not systems or c[0] in systems) and (not faults or c[1] in faults)
    )
    if not cells:
        raise ValueError(f"--systems={systems} --faults={faults}: no cell of the matrix matches")
    worlds = args.worlds
    for w in worlds:
        if w < 2:
            raise ValueError(f"--worlds: {w} ranks cannot lose one; expected >= 2")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    rows = run_matrix(cells, worlds, args.timeout)
    text = [table(rows)]
    if args.errors:
        for row in rows:
            text.append(f"\n{row['system']} {row['fault']} {row['where']} world {row['world']}:")
            text += [f"  {error}" for error in row["errors"]]
    print_tables(args, [rows_table(rows)], "\n".join(text))
    bad = [r for r in rows if any(r[c] == "no" for c in COLUMNS if c != "time to error s")]
    return 1 if bad else 0
