"""A PNG of a simulated timeline (needs matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import os

from xgrad.pipeline.actions import Kind
from xgrad.pipeline.simulate import Simulation

__all__ = ["save_timeline_png"]

_COLOURS = {
    Kind.FORWARD: "#4c72b0",
    Kind.BACKWARD: "#dd8452",
    Kind.BACKWARD_INPUT: "#c44e52",
    Kind.BACKWARD_WEIGHT: "#55a868",
}


def save_timeline_png(sim: Simulation, path: str | os.PathLike[str], title: str = "") -> None:
    """Draw one row per rank, one box per action labelled with its microbatch.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install 'xgrad[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            f"writing a PNG timeline needs matplotlib, which is not installed ({exc}); "
            "install it with: pip install 'xgrad[plot]'"
        ) from None
    p = len(sim.spans)
    fig, ax = plt.subplots(figsize=(max(6.0, sim.makespan * 0.25), 0.6 * p + 1.2))
    for r, spans in enumerate(sim.spans):
        for s in spans:
            ax.broken_barh(
                [(s.start, s.end - s.start)],
                (p - 1 - r - 0.4, 0.8),
                facecolors=_COLOURS[s.action.kind],
                edgecolors="white",
            )
            ax.text(
                (s.start + s.end) / 2,
                p - 1 - r,
                f"{s.action.kind.value}{s.action.microbatch}",
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(p), [f"rank {p - 1 - i}" for i in range(p)])
    ax.set_xlabel("time")
    ax.set_title(title or f"bubble fraction (of total time) {sim.bubble_fraction:.3f}")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)
