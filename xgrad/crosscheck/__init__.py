"""Same model, same data, same bucket plan on several backends: where do the gradients agree?

Every registered backend lists :class:`Runner` objects that turn a
:class:`~xgrad.backend.Step` (the case's model, weights, batch, plan and hook) into reduced
gradients, the plan really used and a time per step; no backend is named here. Each result is measured
against the *single-process float64 reference*: the model's full-batch gradient computed
in float64 (torch in float64 when torch is installed, else the reference backend's numpy
MLP) from the very same weights and batch, which are exact in float64. So the table shows
how far each backend is from the exact answer, not from another backend.

Metrics, per parameter (and per bucket, over the bucket's parameters together):

- ``max_abs``: ``max |g - ref|`` over the elements;
- ``rel``: ``max |g - ref| / max |ref|`` — relative to the parameter's largest gradient,
  which stays meaningful when single elements of ``ref`` are (near) zero; a parameter whose
  reference gradient is all zero uses ``max_abs`` instead;
- ``ulp``: ``max`` over elements of the distance, in units in the last place of ``g``'s
  dtype, between ``g`` and ``ref`` rounded to that dtype (0 = the correctly rounded exact
  value; 1 = a neighbour). Near zero the dtype's numbers are dense, so an element whose
  exact gradient (almost) cancels can be millions of ULPs off while harmless: hence
- ``ulp@max``: ``max |g - ref|`` in ULPs of the dtype at the parameter's largest reference
  magnitude (``rel`` in units of the dtype's precision there).

A backend passes when every parameter's ``rel`` is within :func:`tolerance` of the case:
the dtype's tolerance (:data:`DTYPE_TOLERANCES`), or, with a compression hook, the wire
dtype's (:data:`HOOK_TOLERANCES`), whichever is larger. With a compression hook the
report also compares every backend with a *compression model* — the float64 per-rank
gradients rounded to the model dtype and reduced with the hook's own arithmetic in numpy
— and the torch and JAX backends with each other, in ULPs of the wire dtype at each
parameter's scale (:func:`wire_ulps`), so the
difference between frameworks is attributed to the compression rather than hidden.

PowerSGD (``hook="powersgd"``, torch's ``powerSGD_hook`` at rank 1) is lossy by design, so
its bar is the *PowerSGD model* instead of the exact gradient: torch's algorithm in float64
on the exact per-rank gradients, starting from the very random matrices torch draws, for
the bucket plan each backend ran (:func:`powersgd_model`, :func:`torch_powersgd_qs`).

Backends whose modules cannot be imported are reported as skipped, never crash the run.

Modules: :mod:`~xgrad.crosscheck.case` (configuration, tolerances, inputs),
:mod:`~xgrad.crosscheck.metrics`, :mod:`~xgrad.crosscheck.truth` (references and models),
:mod:`~xgrad.crosscheck.runners`, :mod:`~xgrad.crosscheck.run`,
:mod:`~xgrad.crosscheck.report`. Their public names are re-exported here.
"""

from xgrad.crosscheck.case import DEFAULT_CAP_BYTES as DEFAULT_CAP_BYTES
from xgrad.crosscheck.case import DTYPE_TOLERANCES as DTYPE_TOLERANCES
from xgrad.crosscheck.case import HOOK_TOLERANCES as HOOK_TOLERANCES
from xgrad.crosscheck.case import POWERSGD_FACTOR as POWERSGD_FACTOR
from xgrad.crosscheck.case import WIRE_DTYPES as WIRE_DTYPES
from xgrad.crosscheck.case import Case as Case
from xgrad.crosscheck.case import Inputs as Inputs
from xgrad.crosscheck.case import RunResult as RunResult
from xgrad.crosscheck.case import bucket_plan as bucket_plan
from xgrad.crosscheck.case import make_inputs as make_inputs
from xgrad.crosscheck.case import tolerance as tolerance
from xgrad.crosscheck.compare_backends import agreement as agreement
from xgrad.crosscheck.metrics import Metrics as Metrics
from xgrad.crosscheck.metrics import compare as compare
from xgrad.crosscheck.metrics import compare_buckets as compare_buckets
from xgrad.crosscheck.metrics import ordered_bits as ordered_bits
from xgrad.crosscheck.metrics import ulp_distance as ulp_distance
from xgrad.crosscheck.metrics import wire_ulps as wire_ulps
from xgrad.crosscheck.report import format_report as format_report
from xgrad.crosscheck.report import report_to_dict as report_to_dict
from xgrad.crosscheck.report import write_outputs as write_outputs
from xgrad.crosscheck.run import BackendReport as BackendReport
from xgrad.crosscheck.run import Report as Report
from xgrad.crosscheck.run import run_crosscheck as run_crosscheck
from xgrad.crosscheck.runners import Entry as Entry
from xgrad.crosscheck.runners import Runner as Runner
from xgrad.crosscheck.runners import WorldSizeError as WorldSizeError
from xgrad.crosscheck.runners import check_world_size as check_world_size
from xgrad.crosscheck.runners import runner_entries as runner_entries
from xgrad.crosscheck.runners import runner_names as runner_names
from xgrad.crosscheck.runners import step_of as step_of
from xgrad.crosscheck.truth import POWERSGD_MIN_RATE as POWERSGD_MIN_RATE
from xgrad.crosscheck.truth import POWERSGD_RANK as POWERSGD_RANK
from xgrad.crosscheck.truth import compression_model as compression_model
from xgrad.crosscheck.truth import per_rank_grads as per_rank_grads
from xgrad.crosscheck.truth import powersgd_config as powersgd_config
from xgrad.crosscheck.truth import powersgd_layout as powersgd_layout
from xgrad.crosscheck.truth import powersgd_model as powersgd_model
from xgrad.crosscheck.truth import powersgd_run as powersgd_run
from xgrad.crosscheck.truth import reference_grads as reference_grads
from xgrad.crosscheck.truth import torch_powersgd_qs as torch_powersgd_qs
from xgrad.powersgd import orthogonalize as orthogonalize
