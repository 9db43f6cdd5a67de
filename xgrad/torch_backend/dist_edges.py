"""Where a rank's graph meets the wire: received tensors' nodes, and the hooks of the
tensors xgrad is given.

A received tensor gets a ``RecvBackward`` node of its own (:class:`Recv`), as PyTorch's RPC
gives it ``RecvRpcBackward``: the pass's ``recv`` node, which in-place ops on the tensor do
not move. xgrad's node engine calls torch nodes itself, which runs none of their hooks,
and Python cannot list a node's hooks; for the tensors xgrad is given (roots, sends,
recvs) that may carry some, and the nodes :mod:`.dist_hooks` saw tensor hooks put on,
torch's engine runs them on the summed gradient, once, as PyTorch's engine does before a
node (:func:`recv_hooks`, :func:`hooked_caller`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from xgrad.engine import NodeFunction

__all__ = [
    "Recv",
    "hooked_caller",
    "may_have_hooks",
    "received",
    "received_here",
    "recv_hooks",
    "send_edge",
    "sends_gradient",
]

#: what a received tensor's node hangs from: autograd gives a Function's output a
#: ``grad_fn`` only when an input requires grad. Nothing ever flows into it.
_ANCHOR = torch.empty(0, requires_grad=True)


class Recv(torch.autograd.Function):
    """A received tensor's ``grad_fn``, ``RecvBackward``, as PyTorch's RPC gives it
    ``RecvRpcBackward``.

    The tensor is not a leaf, so in-place ops on it work as on any activation, and its
    node is the pass's ``recv`` node whatever happens to the tensor afterwards (an in-place
    op moves the tensor's ``grad_fn`` on, not the node). xgrad's engine stops there and
    sends the gradient back to the sender. Torch's own engine never runs it in a pass
    (xgrad's takes the gradient at the node); when it does, the gradient reached the
    tensor outside its context's distributed backward (a local ``backward`` through it,
    or another context's pass), where the sender would never get it: that raises, as
    PyTorch's RPC does, rather than drop the gradient without a word.
    """

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, box: list[torch.Tensor], origin: str
    ) -> torch.Tensor:
        ctx.origin = origin
        # The buffer arrives in a list, so autograd does not see it as an input: returned
        # as is (no copy, not a view of an input), it gets this node as its ``grad_fn``.
        return box[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        raise RuntimeError(
            f"a gradient reached the tensor received {ctx.origin} outside that context's "
            "dist_autograd.backward (a local backward through it, or another context's "
            "pass): its sender would never get it; differentiate it with "
            "dist_autograd.backward(context_id, roots) inside its context"
        )


def may_have_hooks(t: torch.Tensor, node: Any) -> bool:
    """Whether tensor hooks of ``t`` (``register_hook``, ``retain_grad``) may sit on
    ``node``, the node its gradient entered when xgrad took it (at a send or a recv).

    Python cannot list a node's hooks. A tensor still on that node with no hook dict and
    no ``retain_grad`` has none there; one changed in place since may (its hooks from
    before stayed on the node).
    """
    return t.grad_fn is not node or t._backward_hooks is not None or t.retains_grad


def _through_hooks(node: Any, slots: Sequence[int], grads: Sequence[Any]) -> Sequence[Any]:
    """``grads`` (of ``node``'s inputs ``slots``) after the hooks on the node, by torch's
    engine: it runs a captured node's hooks (every slot's, None for a slot with no
    gradient, as before running a node) and not the node."""
    edges = [GradientEdge(node, i) for i in slots]
    return torch.autograd.grad(edges, edges, list(grads), retain_graph=True)


def recv_hooks(t: torch.Tensor, node: Any, grad: torch.Tensor) -> torch.Tensor:
    """``grad``, the summed gradient of received tensor ``t``, through the hooks on its node.

    Those are the tensor hooks registered on ``t`` before any in-place op on it (PyTorch
    moves later ones, and ``retain_grad``, to the op's node) and ``retain_grad``'s. A
    tensor without any costs nothing (:func:`may_have_hooks`).
    """
    if not may_have_hooks(t, node):
        return grad
    return _through_hooks(node, [0], [grad])[0]


def hooked_caller(node: Any, run: NodeFunction) -> NodeFunction:
    """``run`` (torch node ``node``'s function) after the hooks on the node's inputs.

    The node engine calls torch nodes itself, which runs none of their hooks; for the
    nodes of the tensors xgrad sees (roots, sends) that may have some, they run here, once
    on the summed gradients, as PyTorch's engine runs them before the node.
    """

    def call(inputs: list[Any]) -> Sequence[Any]:
        given = [i for i, g in enumerate(inputs) if g is not None]
        if given:
            hooked = _through_hooks(node, given, [inputs[i] for i in given])
            inputs = list(inputs)
            for i, g in zip(given, hooked, strict=True):
                inputs[i] = g
        return run(inputs)

    return call


def received(buf: torch.Tensor, origin: str = "") -> tuple[torch.Tensor, Any]:
    """``buf`` (a freshly received tensor) requiring grad through a ``RecvBackward`` node
    (:class:`Recv`), even under ``no_grad`` (as the sent tensor required grad). ``origin``
    says where it came from, for the error of a gradient that reaches it out of its pass
    (``"from rank 0 in context 3"``).

    Returns ``(tensor, node)``: the node stays the recv's after in-place ops on the tensor.
    """
    with torch.enable_grad():
        t = Recv.apply(_ANCHOR, [buf], origin)
    return t, t.grad_fn


def received_here(buf: torch.Tensor, origin: str) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """A received tensor that requires grad, as :func:`received` gives it: ``(the tensor
    returned, the tensor the context keeps, its node)``.

    Under ``torch.inference_mode`` there is no graph: the tensor returned needs no grad (it
    came out an inference tensor that required grad, whose ops were tracked or not by their
    kind, and a sender's gradient could go missing without a word), and a stand-in that no
    root reaches keeps the recv's place, so the sender is told "no gradient".
    """
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            stand_in = torch.empty(buf.shape, dtype=buf.dtype, device=buf.device)
            kept, node = received(stand_in, origin)
        return buf, kept, node
    t, node = received(buf, origin)
    return t, t, node


def sends_gradient(tensor: torch.Tensor) -> bool:
    """Whether a ``send`` of ``tensor`` now takes its gradient back: it requires grad and
    grad mode is on, outside inference mode. As PyTorch's RPC gives a tensor sent with
    grad mode off no gradient back, a tensor sent under ``no_grad`` or ``inference_mode``
    travels detached: a constant on the receiver, nothing flowing back."""
    return (
        tensor.requires_grad and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    )


def send_edge(tensor: torch.Tensor) -> GradientEdge:
    """Where the gradient of a sent ``tensor`` enters its graph, as it is now: an in-place
    op on the tensor later must not move it (PyTorch attaches its send node here too).
    Only for a tensor that :func:`sends_gradient` (outside inference mode, where a leaf's
    gradient accumulator can be made)."""
    return get_gradient_edge(tensor)
