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


def prior_reduction_unfinished(
    missing: Sequence[int], names: Sequence[str], rank: int
) -> RuntimeError:
    """A new iteration started while the previous one still waited for gradients."""
    return RuntimeError(
        "Expected to have finished reduction in the prior iteration before starting a "
        "new one. This error indicates that your module has parameters that were not "
        "used in producing loss. You can enable unused parameter detection by passing "
        "the keyword argument `find_unused_parameters=True`, and by making sure all "
        "outputs of `forward` take part in calculating the loss. "
        + describe_missing(missing, names, rank)
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
