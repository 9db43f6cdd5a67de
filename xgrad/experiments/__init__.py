"""The paper experiments: one module each, run by ``xgrad experiment run NAME``.

An experiment module has ``HELP`` (one line), ``BACKENDS`` (the backends it can run on,
the default first), ``LINKS`` (the links it can use, the default first: ``"sim"``, the
simulated alpha-beta link; ``"real"``, loopback gloo; ``"virtual"``, the reference
backend's virtual clock; ``"none"``), optionally ``add_arguments(parser)``, and
``run(args) -> Report``. :mod:`xgrad.experiments.runner` adds the common options, prints
the report and writes its JSON, CSV and PNG. ``bucket-sweep`` is the older free-standing
sweep with its own options (kept as it was; ``bucket-size`` is its paper figure).
"""

from __future__ import annotations

#: experiment name -> module implementing it (imported when it runs).
EXPERIMENTS: dict[str, str] = {
    "allreduce-size": "xgrad.experiments.allreduce_size",
    "overlap": "xgrad.experiments.overlap",
    "bucket-size": "xgrad.experiments.bucket_size",
    "no-sync": "xgrad.experiments.no_sync",
    "pipeline-bubble": "xgrad.experiments.pipeline_bubble",
    "checkpoint": "xgrad.experiments.checkpoint",
    "schedules": "xgrad.experiments.schedules",
    "compression": "xgrad.experiments.compression",
    "cross-framework": "xgrad.experiments.cross_framework",
    "scaling": "xgrad.experiments.scaling",
    "bucket-sweep": "xgrad.experiments.bucket_sweep",
}

#: one line per experiment, here so that ``xgrad experiment list`` imports nothing heavy.
SUMMARIES: dict[str, str] = {
    "allreduce-size": "allreduce of 1 K to 8 M elements on gloo: fitted alpha and beta, algbw and busbw",
    "overlap": "forward, backward and exposed communication with overlap on and off (DDP paper Fig. 6)",
    "bucket-size": "iteration time against bucket cap: the DDP paper's U shape (Figs. 7-8)",
    "no-sync": "reduce every n iterations: same gradients, communication per sample 1/n (Figs. 10-11)",
    "pipeline-bubble": "GPipe bubble against (p-1)/(m+p-1) for m = 1..32 microbatches",
    "checkpoint": "pipeline checkpointing always / except_last / never: memory and time",
    "schedules": "GPipe, 1F1B, interleaved, ZB-H1, ZB-H2: bubble and activations (zero-bubble Table 2)",
    "compression": "fp16, bf16, PowerSGD ranks 1/2/4: bytes, gradient error, loss, torch and JAX",
    "cross-framework": "torch against JAX on the zoo models: gradient difference per bucket, step time",
    "scaling": "alpha-beta cost model, validated here, extrapolated to 1024 ranks and real models",
    "bucket-sweep": "(older, own options) iteration time vs bucket cap and world size, virtual clock",
}

#: experiments with their own option set, run as they always were.
STANDALONE = frozenset({"bucket-sweep"})
