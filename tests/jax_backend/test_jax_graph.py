"""Backward graphs from jaxprs: dependencies and unused parameters agree with torch's grad_fn walk."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from torch import nn  # noqa: E402

from xgrad import models  # noqa: E402
from xgrad.graph import NodeKind, unused_parameters  # noqa: E402
from xgrad.jax_backend import models as jm  # noqa: E402
from xgrad.jax_backend.graph import backward_graph, find_unused_parameters  # noqa: E402


def _torch_unused(module: nn.Module, x: np.ndarray) -> tuple[int, ...]:
    """DDP's search on the torch twin, with the torch backend's grad_fn walk."""
    from xgrad.torch_backend.autograd_graph import backward_graph as torch_graph
    from xgrad.torch_backend.autograd_graph import find_unused_parameters as torch_unused

    params = list(module.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    out = module(torch.from_numpy(x))
    graph, roots = torch_graph(out, index)
    walked = unused_parameters(graph, roots, num_params=len(params))
    assert walked == torch_unused(out, index, len(params))
    return walked


class Tricky(nn.Module):
    """Parameters unused in every way DDP must notice, next to used ones."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.never = nn.Linear(4, 3)  # not called at all
        self.thrown = nn.Linear(4, 3)  # called, result discarded
        self.frozen = nn.Linear(4, 3)  # weight only through detach(); bias used
        self.pick = nn.Parameter(torch.randn(4))  # only through argmax (no gradient)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.used(x))
        self.thrown(x)
        h = h + nn.functional.linear(x, self.frozen.weight.detach()) + self.frozen.bias
        h = h * x[:, self.pick.argmax()][:, None]
        return self.head(h)


def tricky_jax(p: dict[str, Any], x: Any) -> Any:
    def linear(name: str, v: Any) -> Any:
        return v @ p[f"{name}.weight"].T + p[f"{name}.bias"]

    h = jnp.tanh(linear("used", x))
    linear("thrown", x)
    h = h + x @ jax.lax.stop_gradient(p["frozen.weight"]).T + p["frozen.bias"]
    h = h * x[:, jnp.argmax(p["pick"])][:, None]
    return linear("head", h)


def test_unused_parameters_agree_with_torch_on_the_same_model() -> None:
    module = Tricky()
    names = [n for n, _ in module.named_parameters()]
    weights = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    torch_side = _torch_unused(module, x)
    jax_side = find_unused_parameters(tricky_jax, jm.to_params(weights), x, names=names)
    assert jax_side == torch_side
    # torch lists a module's own parameters (``pick``) before its children's.
    assert [names[i] for i in jax_side] == [
        "pick",
        "never.weight",
        "never.bias",
        "thrown.weight",
        "thrown.bias",
        "frozen.weight",
    ]


@pytest.mark.parametrize("name", models.list_models())
def test_zoo_models_use_every_parameter_in_both_frameworks(name: str) -> None:
    from xgrad.torch_backend.models import build

    w = models.init_weights(name, seed=0, dtype="float32")
    x, _ = models.make_batch(name, seed=0, batch_size=2, dtype="float32")
    jg = backward_graph(jm.get_apply(name), jm.to_params(w), x, names=list(w))
    assert jg.unused() == _torch_unused(build(name, w), x) == ()
    deps = jg.dependencies()
    # Every accumulator is a leaf of the walk, needed, and waits for at least one gradient.
    accs = jg.graph.nodes_of_kind(NodeKind.ACCUMULATE)
    assert sorted(deps.leaves.tolist()) == sorted(accs.tolist())
    assert all(deps.counts[a] >= 1 and deps.needed[a] for a in accs)
    assert [jg.graph.name(int(a)) for a in accs] == list(w)
    assert all(deps.counts[r] == 0 for r in jg.roots)


def test_calls_are_inlined_and_control_flow_is_one_node() -> None:
    """A jitted helper and a custom_jvp are looked through; a cond depends on all its inputs."""

    @jax.jit
    def helper(a: Any, b: Any) -> Any:
        return a * 2.0, b  # b passes through unused

    def f(p: dict[str, Any], x: Any) -> Any:
        used, _ = helper(p["a"], p["b"])
        h = jax.nn.relu(x * used)  # relu is a custom_jvp call
        branch = jax.lax.cond(x.sum() > 0, lambda v: v * p["c"], lambda v: v, h)
        return branch.sum()

    params = {"a": jnp.ones(3), "b": jnp.ones(3), "c": jnp.ones(3)}
    jg = backward_graph(f, params, jnp.ones(3), names=["a", "b", "c"])
    assert jg.unused_names() == ("b",)
    assert "cond" in jg.graph.names
    assert len(jg.roots) == 1


def test_a_parameter_returned_as_output_is_its_own_root() -> None:
    jg = backward_graph(lambda p, x: (p["w"], x * 2.0), {"w": jnp.ones(2)}, jnp.ones(2))
    assert jg.roots == (jg.graph.accumulator(0),)
    assert jg.unused() == ()
