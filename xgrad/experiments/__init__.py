"""The paper experiments, one module each (``HELP``, ``add_arguments``, ``run``)."""

from __future__ import annotations

#: experiment name -> module implementing it (imported when it runs).
EXPERIMENTS: dict[str, str] = {
    "bucket-sweep": "xgrad.experiments.bucket_sweep",
}
