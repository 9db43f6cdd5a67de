"""The reference backend: N ranks simulated in one process, exact sums, numpy models.

Graph, engine, buckets and reducer run end to end here with no framework, and a virtual
clock with an alpha-beta link model times world sizes this machine does not have.

Example:
    >>> from xgrad.reference import mlp_batch, mlp_weights, run_data_parallel, single_process_grads
    >>> w = mlp_weights([4, 8, 2], seed=0)
    >>> x, y = mlp_batch([4, 8, 2], batch_size=8, seed=0)
    >>> dp = run_data_parallel(w, x, y, world_size=4, bucket_cap_bytes=256)
    >>> ref = single_process_grads(w, x, y)
    >>> all(abs(dp[k] - ref[k]).max() < 1e-12 for k in ref)
    True
"""

from __future__ import annotations

from xgrad.numpy_ops import NumpyOps as NumpyOps
from xgrad.reference.clock import LinkModel as LinkModel
from xgrad.reference.clock import VirtualClock as VirtualClock
from xgrad.reference.comm import CollectiveError as CollectiveError
from xgrad.reference.comm import ReferenceComm as ReferenceComm
from xgrad.reference.comm import ReferenceWork as ReferenceWork
from xgrad.reference.comm import World as World
from xgrad.reference.ddp import DataParallel as DataParallel
from xgrad.reference.ddp import run_data_parallel as run_data_parallel
from xgrad.reference.ddp import single_process_grads as single_process_grads
from xgrad.reference.models import MLP as MLP
from xgrad.reference.models import MODELS as MODELS
from xgrad.reference.models import ForwardPass as ForwardPass
from xgrad.reference.models import build_model as build_model
from xgrad.reference.models import mlp_batch as mlp_batch
from xgrad.reference.models import mlp_weights as mlp_weights
from xgrad.reference.rank_threads import RankError as RankError
from xgrad.reference.rank_threads import spawn as spawn
from xgrad.reference.runner import ReferenceRunner as ReferenceRunner
from xgrad.reference.runner import array_ops as array_ops
from xgrad.reference.runner import run_ranks as run_ranks
from xgrad.reference.runner import runners as runners
from xgrad.reference.runner import truth as truth

name = "reference"


def available() -> bool:
    """Always: the reference backend needs only numpy."""
    return True
