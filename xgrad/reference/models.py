"""Small numpy models whose backward pass is an xgrad graph run by the xgrad engine.

A forward pass records what autograd would: one backward node per operation, one
accumulator per parameter, edges in output order. So graph, engine, buckets and reducer
run end to end with no framework.

MLP convention (shared with ``xgrad.models``): parameters ``layers.{i}.weight`` (out, in)
and ``layers.{i}.bias`` (out,), layer by layer; tanh after every layer but the last; loss
``((out - y) ** 2).mean()``. Parameters with other names are held but take no part in
the forward pass (the unused-parameter case of DDP).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from xgrad.engine import NodeFunction
from xgrad.graph import BackwardGraph
from xgrad.graph_builder import GraphBuilder

#: the reference model family: name -> one line.
MODELS: dict[str, str] = {
    "mlp": "tanh MLP with MSE loss (parameters layers.{i}.weight / layers.{i}.bias)",
    "mlp_unused": "the MLP plus parameters that take no part in the forward pass",
}

_LAYER = re.compile(r"^layers\.(\d+)\.(weight|bias)$")


@dataclass(frozen=True)
class ForwardPass:
    """One forward pass: the loss and everything its backward pass needs.

    Attributes:
        loss: the scalar loss (0-d array in the parameters' dtype).
        output: the model output.
        graph: the recorded backward graph.
        functions: the backward function of each function node (closing over activations).
        root: the loss's backward node (its gradient seeds the pass).
    """

    loss: np.ndarray
    output: np.ndarray
    graph: BackwardGraph
    functions: dict[int, NodeFunction]
    root: int


class MLP:
    """The MLP of the shared convention, in numpy, recording its backward graph.

    Args:
        weights: parameters by name in index order; ``layers.*`` ones are used, any other
            is held but unused.
        charge: called with the floating-point operations of each forward and backward
            step (the reference backend turns them into virtual time).

    Attributes:
        names, params: parameter names and arrays in index order (the plan's indices).
    """

    def __init__(
        self,
        weights: Mapping[str, np.ndarray],
        *,
        charge: Callable[[float], None] | None = None,
    ) -> None:
        self.names: tuple[str, ...] = tuple(weights)
        self.params: list[np.ndarray] = [np.asarray(weights[k]) for k in self.names]
        index = {name: i for i, name in enumerate(self.names)}
        layers: dict[int, dict[str, int]] = {}
        for name in self.names:
            m = _LAYER.match(name)
            if m:
                layers.setdefault(int(m.group(1)), {})[m.group(2)] = index[name]
        if not layers:
            raise ValueError(f"weights {list(self.names)} hold no layers.{{i}}.weight/bias")
        if sorted(layers) != list(range(len(layers))):
            raise ValueError(f"MLP layer numbers {sorted(layers)} must be 0..{len(layers) - 1}")
        self.layers: list[tuple[int, int]] = []
        for i in range(len(layers)):
            got = layers[i]
            if set(got) != {"weight", "bias"}:
                raise ValueError(f"layer {i} has {sorted(got)}, needs weight and bias")
            w, b = self.params[got["weight"]], self.params[got["bias"]]
            if w.ndim != 2 or b.shape != (w.shape[0],):
                raise ValueError(
                    f"layers.{i}.weight shape {w.shape} and layers.{i}.bias shape {b.shape} "
                    "do not make a Linear layer (out, in) / (out,)"
                )
            if self.layers:
                prev = self.params[self.layers[-1][0]]
                if prev.shape[0] != w.shape[1]:
                    raise ValueError(
                        f"layers.{i}.weight takes {w.shape[1]} inputs but layer {i - 1} "
                        f"gives {prev.shape[0]}"
                    )
            self.layers.append((got["weight"], got["bias"]))
        used = {i for pair in self.layers for i in pair}
        self.unused: tuple[int, ...] = tuple(i for i in range(len(self.names)) if i not in used)
        self._charge = charge

    def _flops(self, n: float) -> None:
        if self._charge is not None:
            self._charge(n)

    def forward(self, x: np.ndarray, y: np.ndarray) -> ForwardPass:
        """Run the forward pass and record its backward graph."""
        w0 = self.params[self.layers[0][0]]
        if x.ndim != 2 or x.shape[1] != w0.shape[1]:
            raise ValueError(f"x has shape {x.shape}, expected (batch, {w0.shape[1]})")
        b = GraphBuilder()
        fns: dict[int, NodeFunction] = {}
        h = x
        prev: int | None = None  # the node that takes the gradient of h (None: the input)
        last = len(self.layers) - 1
        for i, (wi, bi) in enumerate(self.layers):
            w, bias = self.params[wi], self.params[bi]
            acc_w = b.add_node("accumulate", self.names[wi], param=wi)
            acc_b = b.add_node("accumulate", self.names[bi], param=bi)
            z = h @ w.T + bias
            self._flops(2.0 * h.shape[0] * w.size)
            lin = b.add_node("function", f"LinearBackward[{i}]")
            if prev is not None:
                b.add_edge(lin, prev)
            b.add_edge(lin, acc_w)
            b.add_edge(lin, acc_b)
            fns[lin] = self._linear_backward(h, w, with_input=prev is not None)
            prev = lin
            if i < last:
                h = np.tanh(z)
                tanh = b.add_node("function", f"TanhBackward[{i}]")
                b.add_edge(tanh, prev)
                fns[tanh] = _tanh_backward(h)
                prev = tanh
            else:
                h = z
        if y.shape != h.shape:
            raise ValueError(f"y has shape {y.shape}, the output has shape {h.shape}")
        diff = h - y
        loss = np.asarray(np.mean(diff * diff), dtype=h.dtype)
        root = b.add_node("function", "MseLossBackward")
        assert prev is not None
        b.add_edge(root, prev)
        fns[root] = _mse_backward(diff)
        return ForwardPass(loss, h, b.build(), fns, root)

    def _linear_backward(self, h: np.ndarray, w: np.ndarray, *, with_input: bool) -> NodeFunction:
        def backward(grads: list[Any]) -> Sequence[Any]:
            g = grads[0]
            gw = g.T @ h
            gb = g.sum(axis=0)
            self._flops(2.0 * h.shape[0] * w.size * (2 if with_input else 1))
            return [g @ w, gw, gb] if with_input else [gw, gb]

        return backward


def _tanh_backward(t: np.ndarray) -> NodeFunction:
    def backward(grads: list[Any]) -> Sequence[Any]:
        return [grads[0] * (1 - t * t)]

    return backward


def _mse_backward(diff: np.ndarray) -> NodeFunction:
    scale = diff.dtype.type(2.0 / diff.size)

    def backward(grads: list[Any]) -> Sequence[Any]:
        return [grads[0] * scale * diff]

    return backward


def build_model(
    name: str, weights: Mapping[str, np.ndarray], *, charge: Callable[[float], None] | None = None
) -> MLP:
    """A reference model by name (see :data:`MODELS`), checked against its weights."""
    if name not in MODELS:
        raise ValueError(f"model={name!r} is not a reference model; known: {sorted(MODELS)}")
    model = MLP(weights, charge=charge)
    if name == "mlp" and model.unused:
        raise ValueError(
            f"model='mlp' uses every parameter but {[model.names[i] for i in model.unused]} "
            "are not layers.{i}.*; use model='mlp_unused'"
        )
    if name == "mlp_unused" and not model.unused:
        raise ValueError("model='mlp_unused' needs at least one parameter outside layers.*")
    return model


def mlp_weights(
    sizes: Sequence[int],
    *,
    seed: int = 0,
    dtype: DTypeLike = "float64",
    unused: Sequence[tuple[str, tuple[int, ...]]] = (),
) -> dict[str, np.ndarray]:
    """Seeded MLP weights for layer widths ``sizes`` (input, hidden..., output).

    ``unused`` adds parameters ``(name, shape)`` after the layers that the forward pass
    does not touch. Values are uniform in ``±1/sqrt(fan_in)`` like torch's Linear.
    """
    if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
        raise ValueError(f"sizes={list(sizes)} needs >= 2 positive widths")
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        bound = 1.0 / np.sqrt(fan_in)
        out[f"layers.{i}.weight"] = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(dtype)
        out[f"layers.{i}.bias"] = rng.uniform(-bound, bound, (fan_out,)).astype(dtype)
    for name, shape in unused:
        if _LAYER.match(name) or name in out:
            raise ValueError(f"unused parameter name {name!r} clashes with a layer parameter")
        out[name] = rng.uniform(-0.1, 0.1, shape).astype(dtype)
    return out


def mlp_batch(
    sizes: Sequence[int], batch_size: int, *, seed: int = 0, dtype: DTypeLike = "float64"
) -> tuple[np.ndarray, np.ndarray]:
    """A seeded standard-normal batch ``(x, y)`` for an MLP with widths ``sizes``."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    rng = np.random.default_rng([seed, 1])
    x = rng.standard_normal((batch_size, sizes[0])).astype(dtype)
    y = rng.standard_normal((batch_size, sizes[-1])).astype(dtype)
    return x, y
