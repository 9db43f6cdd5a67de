"""xgrad: distributed gradient computation that is the same across frameworks.

The core (this package, outside ``torch_backend`` and ``jax_backend``) never imports
torch or jax: it says *what* happens — dependency counts, bucket plans, the reducer's
state machine, pipeline schedules — and backends say *how*.
"""

from xgrad import pipeline as pipeline
from xgrad.backend import Comm as Comm
from xgrad.backend import Work as Work
from xgrad.backend import get_backend as get_backend
from xgrad.backend import list_backends as list_backends
from xgrad.backend import register_backend as register_backend
from xgrad.buckets import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from xgrad.buckets import DEFAULT_FIRST_BUCKET_BYTES as DEFAULT_FIRST_BUCKET_BYTES
from xgrad.buckets import BucketPlan as BucketPlan
from xgrad.buckets import assign_buckets as assign_buckets
from xgrad.buckets import ddp_initial_plan as ddp_initial_plan
from xgrad.buckets import rebuild_plan as rebuild_plan
from xgrad.dependencies import Dependencies as Dependencies
from xgrad.dependencies import compute_dependencies as compute_dependencies
from xgrad.dependencies import reachable_from as reachable_from
from xgrad.dependencies import unused_parameters as unused_parameters
from xgrad.engine import BackwardError as BackwardError
from xgrad.engine import DistBackwardError as DistBackwardError
from xgrad.engine import DistContext as DistContext
from xgrad.engine import Engine as Engine
from xgrad.engine import PassResult as PassResult
from xgrad.graph import BackwardGraph as BackwardGraph
from xgrad.graph import NodeKind as NodeKind
from xgrad.graph_builder import GraphBuilder as GraphBuilder
from xgrad.numpy_ops import NumpyOps as NumpyOps
from xgrad.reducer import GradBucket as GradBucket
from xgrad.reducer import IterationRecord as IterationRecord
from xgrad.reducer import Reducer as Reducer

__version__ = "0.1.0"
