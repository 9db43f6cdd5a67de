"""The reducer's errors, worded as PyTorch's DDP words them, naming parameters and the rank.

Kept apart from the state machine so that every message a user can see from the reducer
is in one place, with what it names: the parameter (index and name) and the rank.
"""

from __future__ import annotations

from collections.abc import Sequence


def describe_missing(missing: Sequence[int], names: Sequence[str], rank: int) -> str:
    """DDP's two lines listing the parameters that received no gradient on ``rank``."""
    return (
        f"Parameter indices which did not receive grad for rank {rank}: "
        f"{' '.join(map(str, missing))}\n"
        f"Parameters which did not receive grad for rank {rank}: "
        f"{', '.join(names[i] for i in missing)}"
    )


#: PyTorch's sentences of its "prior iteration" error (``reducer.cpp``), word for word:
#: its own tests, and users' scripts, look for them.
_PRIOR = "Expected to have finished reduction in the prior iteration before starting a new one. "
_NOT_USED = (
    "This error indicates that your module has parameters that were not used in producing loss. "
)
_OUTPUTS = "making sure all `forward` function outputs participate in calculating loss. "
_NOT_LOCATED = (
    "\nIf you already have done the above, then the distributed data parallel module wasn't "
    "able to locate the output tensors in the return value of your module's `forward` "
    "function. Please include the loss function and the structure of the return value of "
    "`forward` of your module when reporting this issue (e.g. list, dict, iterable)."
)
_DEBUG_HINT = (
    "\n In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either "
    "INFO or DETAIL to print out information about which particular parameters did not "
    "receive gradient on this rank as part of this error"
)


def prior_reduction_unfinished(
    missing: Sequence[int],
    names: Sequence[str],
    rank: int,
    *,
    static_graph: bool = False,
    find_unused: bool = False,
    name_params: bool = True,
) -> RuntimeError:
    """A new iteration started while the previous one still waited for gradients.

    PyTorch's text for each case (a static graph, ``find_unused_parameters`` on or off).
    ``name_params``: the parameters' names too, as PyTorch gives them when
    ``TORCH_DISTRIBUTED_DEBUG`` is INFO or DETAIL; otherwise its hint to set it.
    """
    if static_graph:
        text = _PRIOR + _GRAPH_CHANGED.format("used", "unused").replace(
            "Your training graph", "This error indicates that your training graph", 1
        )
    elif find_unused:
        text = (
            _PRIOR
            + _NOT_USED
            + "Since `find_unused_parameters=True` is enabled, this likely  means that not "
            "all `forward` outputs participate in computing loss. You can fix this by "
            + _OUTPUTS
            + _NOT_LOCATED
        )
    else:
        text = (
            _PRIOR
            + _NOT_USED
            + "You can enable unused parameter detection by passing the keyword argument "
            "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, "
            "and by \n" + _OUTPUTS + _NOT_LOCATED
        )
    indices = (
        f"\nParameter indices which did not receive grad for rank {rank}: "
        f"{' '.join(map(str, missing))}"
    )
    if not name_params:
        return RuntimeError(text + indices + _DEBUG_HINT)
    listed = ", ".join(names[i] for i in missing)
    return RuntimeError(
        f"{text}\nParameters which did not receive grad for rank {rank}: {listed}{indices}"
    )


def marked_ready_twice(index: int, names: Sequence[str], rank: int) -> RuntimeError:
    """A gradient hook fired twice for one parameter in one backward pass."""
    return RuntimeError(
        "Expected to mark a variable ready only once. This error is caused by one of "
        "the following reasons: 1) Use of a module parameter outside the `forward` "
        "function, 2) Reused parameters in multiple reentrant backward passes, "
        "3) Incorrect unused parameter detection. "
        f"Parameter at index {index} with name {names[index]} has been marked "
        f"as ready twice on rank {rank}."
    )


#: PyTorch's words for a static graph whose parameters changed from the first iteration.
_GRAPH_CHANGED = (
    "Your training graph has changed in this iteration, e.g., one parameter is {} in first "
    "iteration, but then got {} in the second iteration. this is not compatible with "
    "static_graph set to True."
)


def static_graph_now_used(index: int, names: Sequence[str], rank: int) -> RuntimeError:
    """A static graph's parameter unused in the first iteration got a gradient now."""
    return RuntimeError(
        _GRAPH_CHANGED.format("unused", "used")
        + f" Parameter at index {index} with name {names[index]} on rank {rank}."
    )


def static_graph_now_unused(
    missing: Sequence[int], names: Sequence[str], rank: int
) -> RuntimeError:
    """A static graph's parameters used in the first iteration got no gradient now."""
    return RuntimeError(
        _GRAPH_CHANGED.format("used", "unused") + "\n" + describe_missing(missing, names, rank)
    )


def buckets_never_reduced(
    missing: Sequence[int], names: Sequence[str], rank: int, find_unused: bool = False
) -> RuntimeError:
    """The backward pass ended with buckets still waiting for gradients."""
    advice = (
        "find_unused_parameters is on, so they were reachable from the forward's outputs "
        "but the backward pass did not reach them: it did not start from the outputs, or "
        "the loss left out a tensor DDP could not route (return tuples, lists, dicts or "
        "namedtuples, not dataclasses). "
        if find_unused
        else "Pass find_unused_parameters=True if parts of the model are legitimately unused. "
    )
    return RuntimeError(
        "Some parameters received no gradient in this backward pass, so their "
        "buckets were never reduced. " + advice + describe_missing(missing, names, rank)
    )


def sparse_gradient_missing(index: int, names: Sequence[str], rank: int) -> RuntimeError:
    """A parameter with a sparse gradient was marked ready without one (it went unused)."""
    return RuntimeError(
        f"Expected sparse gradient to be defined: parameter at index {index} with name "
        f"{names[index]} got no gradient on rank {rank}"
    )


class GradientDtypeError(RuntimeError):
    """A gradient's dtype is not its bucket's: the module was converted after its DDP was
    made. Its own type, so the end of a pass raises it as the pass's failure rather than
    taking it for a pass that left buckets waiting (a static graph's first iteration
    copies its gradients in there)."""


def gradient_dtype_mismatch(
    index: int, grad_dtype: str, bucket_dtype: str, names: Sequence[str], rank: int
) -> GradientDtypeError:
    """A gradient of another dtype than its bucket.

    The copy would otherwise round it to the bucket's dtype and every step reduce it so,
    without a word. PyTorch's reducer checks a gradient's type against its bucket view's,
    but after ``module.double()`` its hooks never run (they stay on the gradient
    accumulators the conversion replaced), so every rank keeps its local gradient.
    """
    return GradientDtypeError(
        f"The gradient of parameter at index {index} with name {names[index]} is "
        f"{grad_dtype} but its bucket holds {bucket_dtype} on rank {rank}: the module's "
        "parameters were converted (module.double(), .half(), .to(dtype), perhaps of one "
        "submodule) after DistributedDataParallel was constructed, and its buckets keep "
        "the dtypes they were made with. Convert the module before constructing "
        "DistributedDataParallel (or wrap it again after converting it), or convert "
        "through the DDP itself (ddp.double()), which makes its buckets again."
    )
