"""The simulated link as the experiments report it; the link itself is :mod:`xgrad.link`.

It lives one floor down, in the core, so that the backends' per-rank experiment workers
(which may not import :mod:`xgrad.experiments`) can book their messages on it.
"""

from __future__ import annotations

from xgrad.link import DEFAULT_ALPHA, DEFAULT_BETA, SimulatedLink, make_link
from xgrad.reference.clock import LinkModel

__all__ = ["DEFAULT_ALPHA", "DEFAULT_BETA", "SimulatedLink", "link_description", "make_link"]


def link_description(kind: str, model: LinkModel | None = None) -> str:
    """The ``link`` line of a report."""
    if kind == "real":
        return "real loopback gloo (127.0.0.1, shares the CPU with the computation)"
    if kind == "sim" and model is not None:
        return (
            f"simulated alpha-beta link (real gloo reduction, then a wait of the ring time; "
            f"alpha {model.alpha * 1e6:g} us, {1 / model.beta / 1e9:g} GB/s)"
            if model.beta
            else f"simulated alpha-beta link (alpha {model.alpha * 1e6:g} us, infinite bandwidth)"
        )
    if kind == "virtual" and model is not None:
        return (
            f"virtual clock (reference backend, alpha {model.alpha * 1e6:g} us, "
            f"{1 / model.beta / 1e9:g} GB/s ring allreduce; compute charged per flop)"
        )
    return kind
