"""Hooks and flags that reach the nodes of a context's graph, seen where they are registered.

xgrad's node engine calls torch's nodes itself, which runs none of their hooks, and
Python cannot list a node's hooks nor read a Python Function's ``materialize_grads``.
Without this, a hook on an intermediate tensor (``h.register_hook(lambda g: g * 10)``)
was skipped and the pass's gradients came out wrong without a word. So while a thread
has a distributed autograd context open, the Python entry points that put them on a
node record the node in that context's :class:`Seen`:

* ``Tensor.register_hook`` and ``Tensor.retain_grad`` of a tensor with a ``grad_fn``:
  the node carries tensor pre-hooks, which the engine runs through torch's own engine
  on the node's summed input gradient (:func:`.dist_edges.hooked_caller`);
* a Python Function node's ``register_prehook`` and ``register_hook`` (a module's full
  backward hooks use them): the handle leads to the node's ordered hook dict, and the
  engine calls the hooks around the node as PyTorch's engine does (:func:`call_node_hooks`);
* ``register_prehook``/``register_hook`` on a C++ node (``y.grad_fn``, a leaf's
  ``AccumulateGrad``), whose type cannot be changed: every node hook reaches torch's
  ``Function._register_hook``, which says only that one was registered, not where. So
  the pass then asks each C++ node of its graph for its hook dicts (:func:`probe`), and
  runs what it finds as above; on a leaf's accumulator, as PyTorch's distributed engine
  does: the pre-hooks on the summed gradient, then the post-hooks;
* ``ctx.set_materialize_grads(False)`` in a Python Function's forward: its backward gets
  None, not zeros, for an output no gradient reached.

The entry points are replaced while any context is open, on any thread, and restored when
the last one closes; a registration on a thread without an open context is not recorded.
Not seen: hooks registered before the context opened on tensors and nodes its graph
reaches. Torch's engine runs those (``dist_autograd.EXECUTE = "waves"``), once per wave
through the node.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction, Function, FunctionCtx

__all__ = ["Seen", "accumulator_hooks", "begin", "call_node_hooks", "end", "probe"]


class Seen:
    """What one context saw registered on nodes (strong references: a node's id must not
    be reused while the context may look it up; the context holds its graph anyway).

    Attributes:
        tensor_hooked: id -> node that tensor hooks (``register_hook``, ``retain_grad``)
            were put on.
        tensors: the tensors those hooks were registered on, weakly: an in-place op moves
            a tensor (and its ``retain_grad``) to a new node.
        node_hooks: id -> ``(node, its pre-hook dict or None, its post-hook dict or None)``,
            for Python Function nodes (live dicts: a hook removed since is not run).
        unmaterialized: id -> node of the Python Functions that called
            ``set_materialize_grads(False)``.
        cpp_node_hooks: whether a hook was registered on a C++ node (which one is not
            known: the pass probes its C++ nodes, :func:`probe`).
    """

    def __init__(self) -> None:
        self.tensor_hooked: dict[int, Any] = {}
        self.tensors: list[weakref.ref[torch.Tensor]] = []
        self.node_hooks: dict[int, tuple[Any, Any, Any]] = {}
        self.unmaterialized: dict[int, Any] = {}
        self.cpp_node_hooks = False
        #: which distributed pass of the context runs now (None: none), for "any" hooks
        self.pass_key: object = None

    def hooked_nodes(self) -> list[Any]:
        """Every node tensor hooks may sit on: those they were put on, and the current
        ``grad_fn`` of each tensor still alive."""
        nodes = list(self.tensor_hooked.values())
        for ref in self.tensors:
            t = ref()
            if t is not None and t.grad_fn is not None:
                nodes.append(t.grad_fn)
        return nodes


_local = threading.local()
_lock = threading.Lock()
_open = 0  # contexts open in this process, every thread


def _seen() -> Seen | None:
    return getattr(_local, "seen", None)


def _tensor_hooked(t: torch.Tensor) -> None:
    seen = _seen()
    node = t.grad_fn
    if seen is not None and node is not None:
        seen.tensor_hooked[id(node)] = node
        seen.tensors.append(weakref.ref(t))


def _register_hook(self: torch.Tensor, hook: Callable[..., Any]) -> Any:
    handle = _ORIGINAL[(torch.Tensor, "register_hook")](self, hook)
    _tensor_hooked(self)
    return handle


def _retain_grad(self: torch.Tensor) -> None:
    _ORIGINAL[(torch.Tensor, "retain_grad")](self)
    _tensor_hooked(self)


def _node_hook(slot: int, name: str) -> Callable[..., Any]:
    def register(self: Any, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        _local.python_node = True  # not a C++ node's (:func:`_function_hook`)
        try:
            handle = _ORIGINAL[(BackwardCFunction, name)](self, hook, *args, **kwargs)
        finally:
            _local.python_node = False
        seen = _seen()
        if seen is not None:
            _, pre, post = seen.node_hooks.get(id(self), (self, None, None))
            hooks = handle.hooks_dict_ref()  # the node's dict of every such hook
            seen.node_hooks[id(self)] = (self, hooks, post) if slot == 1 else (self, pre, hooks)
        return handle

    return register


def _function_hook(backward_hooks: Any, hook: Callable[..., Any]) -> Any:
    """``Function._register_hook``, which torch's C++ calls for every node hook: with the
    node's hook dict so far (None: none yet). Tells :func:`probe` that dict, and the
    context that a C++ node got a hook."""
    result = _ORIGINAL[(Function, "_register_hook")](backward_hooks, hook)
    probing: list[Any] | None = getattr(_local, "probing", None)
    if probing is not None:
        probing.append(backward_hooks)
    elif not getattr(_local, "python_node", False):
        seen = _seen()
        if seen is not None:
            seen.cpp_node_hooks = True
    return result


def _noop(*args: Any) -> None:
    return None


def probe(node: Any) -> tuple[Any, Any]:
    """``node``'s pre-hook and post-hook dicts (None: it has no such hook).

    Torch gives them to ``Function._register_hook`` when a hook is registered: one is
    registered and removed again. A node without such hooks keeps an empty dict, which
    torch's engine runs as nothing. Only while a context is open (:func:`begin`).
    """
    found: list[Any] = []
    _local.probing = found
    try:
        node.register_prehook(_noop).remove()
        node.register_hook(_noop).remove()
    finally:
        _local.probing = None
    if len(found) != 2:  # not a node torch hooks through Function._register_hook
        return None, None
    pre, post = found
    return pre or None, post or None


def _set_materialize_grads(self: Any, value: bool) -> None:
    _ORIGINAL[(FunctionCtx, "set_materialize_grads")](self, value)
    seen = _seen()
    if seen is not None and isinstance(self, BackwardCFunction):
        if value:
            seen.unmaterialized.pop(id(self), None)
        else:
            seen.unmaterialized[id(self)] = self


def _multi_grad_hook(
    tensors: Sequence[torch.Tensor], fn: Callable[..., Any], *, mode: str = "all"
) -> Any:
    """``register_multi_grad_hook``: with ``mode="any"`` inside a context, the hook runs
    once per distributed pass, as once per backward call in torch. Torch's keys its "ran
    already" by the graph task, and xgrad's engine runs each node's hooks in a graph task
    of their own, so the hook ran once for every tensor a gradient reached."""
    seen = _seen()
    original = _ORIGINAL[(torch.autograd.graph, "register_multi_grad_hook")]
    if mode != "any" or seen is None:
        return original(tensors, fn, mode=mode)
    lock, ran = threading.Lock(), set()

    def once(grad: torch.Tensor) -> None:
        key = seen.pass_key
        if key is None:  # a backward outside the context's passes: torch's rule
            key = torch._C._current_graph_task_id()
        with lock:
            if key in ran:
                return
            ran.add(key)
        fn(grad)

    handles = tuple(t.register_hook(once) for t in tensors if t.requires_grad)
    return torch.autograd.graph._MultiHandle(handles)


#: (class, attribute) -> torch's own, as looked up on the class (maybe inherited).
_ORIGINAL: dict[tuple[Any, str], Any] = {}
_REPLACEMENT: dict[tuple[Any, str], Any] = {
    (torch.autograd.graph, "register_multi_grad_hook"): _multi_grad_hook,
    (torch.Tensor, "register_hook"): _register_hook,
    (torch.Tensor, "retain_grad"): _retain_grad,
    (BackwardCFunction, "register_prehook"): _node_hook(1, "register_prehook"),
    (BackwardCFunction, "register_hook"): _node_hook(2, "register_hook"),
    (FunctionCtx, "set_materialize_grads"): _set_materialize_grads,
    (Function, "_register_hook"): staticmethod(_function_hook),
}
#: whether the class itself defines the attribute (if not, restoring deletes ours).
_OWN: dict[tuple[Any, str], bool] = {}
for _key, _replacement in _REPLACEMENT.items():
    _ORIGINAL[_key] = getattr(_key[0], _key[1])
    _OWN[_key] = _key[1] in _key[0].__dict__
    # help() shows torch's own
    functools.update_wrapper(getattr(_replacement, "__func__", _replacement), _ORIGINAL[_key])


def begin(seen: Seen) -> None:
    """This thread's context opens: record into ``seen`` until :func:`end`."""
    global _open
    _local.seen = seen
    with _lock:
        _open += 1
        if _open == 1:
            for (cls, name), replacement in _REPLACEMENT.items():
                setattr(cls, name, replacement)


def end() -> None:
    """This thread's context closed; the last one to close restores torch's entry points."""
    global _open
    _local.seen = None
    with _lock:
        _open -= 1
        if _open == 0:
            for (cls, name), original in _ORIGINAL.items():
                if _OWN[(cls, name)]:
                    setattr(cls, name, original)
                else:
                    delattr(cls, name)


def _returned(hook: Any, got: Any, want: int) -> tuple[Any, ...]:
    if not isinstance(got, (tuple, list)) or len(got) != want:
        n = len(got) if isinstance(got, (tuple, list)) else type(got).__name__
        raise RuntimeError(
            f"hook '{getattr(hook, '__name__', hook)}' has returned an incorrect number of "
            f"values (got {n}, but expected {want})"
        )
    return tuple(got)


def call_node_hooks(
    pre: Mapping[Any, Any] | None,
    post: Mapping[Any, Any] | None,
    run: Callable[[list[Any]], Sequence[Any]],
    inputs: list[Any],
) -> tuple[Any, ...]:
    """``run(inputs)`` (a node's function, one result per next edge) between the node's
    hooks, as PyTorch's engine calls them: each pre-hook gets the gradients of the node's
    outputs (None where none came) and may return new ones; each post-hook gets the node's
    results and those gradients and may return new results. ``pre``/``post``: the node's
    hook dicts (live: a hook removed since is not run), or None."""
    grad_outputs = tuple(inputs)
    for hook in list(pre.values()) if pre else ():
        got = hook(grad_outputs)
        if got is not None:
            grad_outputs = _returned(hook, got, len(grad_outputs))
    results = tuple(run(list(grad_outputs)))
    for hook in list(post.values()) if post else ():
        got = hook(results, grad_outputs)
        if got is not None:
            results = _returned(hook, got, len(results))
    return results


def accumulator_hooks(
    pre: Mapping[Any, Any] | None, post: Mapping[Any, Any] | None, grad: Any
) -> Any:
    """A leaf's summed gradient through its ``AccumulateGrad``'s hooks, as PyTorch's
    distributed engine runs them where it takes the gradient into the context: each
    pre-hook may replace it; the post-hooks get no results and the gradient (what they
    return is not used)."""
    grads = (grad,)
    for hook in list(pre.values()) if pre else ():
        got = hook(grads)
        if got is not None:
            grads = _returned(hook, got, 1)
    for hook in list(post.values()) if post else ():
        hook((), grads)
    return grads[0]
