"""One step of a failure test, recorded: what it raised, how long it took, what it warned.

The DDP failure tests run a sequence of steps on every rank, some failing on purpose, and
compare each step's record across ranks afterwards.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any


def recorded(record: dict[str, Any], body: Callable[[], None]) -> dict[str, Any]:
    """Run ``body`` and fill ``record`` in: ``error`` (the exception's type and text, empty
    when none), ``origin`` (the rank a :class:`~xgrad.failure.RankError` names),
    ``seconds``, ``warning`` (every warning's text) and ``warned_at`` (their files)."""
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            body()
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["origin"] = getattr(exc, "rank", None)
    record["seconds"] = time.monotonic() - start
    record["warning"] = " | ".join(str(w.message) for w in caught)
    record["warned_at"] = sorted({w.filename for w in caught})
    return record


def grads_are(model: Any, expected: dict[str, Any]) -> bool:
    """Whether every ``.grad`` of ``model`` is ``expected``'s, by name (the full batch's,
    in the failure tests: a failed step must leave the next one right)."""
    import torch

    return all(
        torch.allclose(p.grad, expected[n], rtol=1e-5, atol=1e-6)
        for n, p in model.named_parameters()
    )
