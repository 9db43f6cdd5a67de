"""W from the joins: exactly the plain backward's gradients, a plan followed per microbatch,
a full walk again when the graph changes, no plan for the graphs it cannot handle."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.autograd.graph import get_gradient_edge  # noqa: E402

from xgrad.torch_backend import pipeline_joins as pj  # noqa: E402


def mlp(layers: int = 3, width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


def plain(module: nn.Module, xs: list[Any], grad: Any) -> tuple[list[Any], list[Any]]:
    """Input and parameter gradients of one whole backward."""
    ins = [x.detach().requires_grad_() for x in xs]
    module.zero_grad(set_to_none=True)
    module(*ins).backward(grad)
    out = [x.grad for x in ins], [p.grad for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return out


def split(
    joins: pj.StageJoins, module: nn.Module, xs: list[Any], grad: Any, *, root: str = "output"
) -> tuple[list[Any], list[Any], bool]:
    """I then W as the runtime runs them; whether W started from the joins. ``root``: the
    output itself (recomputed), or its gradient edge (what the runtime keeps of a sent one)."""
    ins = [x.detach().requires_grad_() for x in xs]
    y = module(*ins)
    outs: list[Any] = [y]
    grads = [grad]
    if root == "edge":
        outs = [get_gradient_edge(y)]

    params = [p for p in module.parameters()]
    found = joins.edges(0, outs, ins, lambda: params)
    edges = [] if found is None else found[1]
    got = torch.autograd.grad(outs, [*ins, *edges], grads, retain_graph=True, allow_unused=True)
    if found is None:
        torch.autograd.backward(outs, grads, inputs=params)
    else:
        pj.run_weight(pj.Captured(found[0], edges, list(got[len(ins) :])))
    out = list(got[: len(ins)]), [p.grad for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return out[0], out[1], found is not None


def same(a: list[Any], b: list[Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Counted:
    """Counts the full walks (``analyse`` calls)."""

    def __init__(self, monkeypatch: Any) -> None:
        self.walks = 0
        real = pj.analyse

        def analyse(*args: Any) -> Any:
            self.walks += 1
            return real(*args)

        monkeypatch.setattr(pj, "analyse", analyse)


@pytest.mark.parametrize("root", ["output", "edge"])
def test_chain_is_exact_and_walked_once(monkeypatch: Any, root: str) -> None:
    counted = Counted(monkeypatch)
    module, joins = mlp(), pj.StageJoins()
    hooked: list[int] = []
    for p in module.parameters():  # DDP's kind of hook: it must run in W
        p.register_post_accumulate_grad_hook(lambda p: hooked.append(id(p)))
    for mb in range(4):
        g = torch.Generator().manual_seed(mb)
        x, grad = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        want_in, want_p = plain(module, [x], grad)
        hooked.clear()
        got_in, got_p, used = split(joins, module, [x], grad, root=root)
        assert used
        assert same(got_in, want_in) and same(got_p, want_p)
        assert sorted(hooked) == sorted(id(p) for p in module.parameters())
    assert counted.walks == 1
    plan = next(iter(joins.plans.values()))
    assert plan is not None and len(plan.groups) == 3  # one per Linear (weight and bias)


class TwoInputs(nn.Module):
    """Two inputs, a parameter on an input-free branch, a parameter used twice side by side."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(8))

    def forward(self, x1: Any, x2: Any) -> Any:
        return torch.tanh(self.a(x1)) * (self.scale * 2) + self.a(x2) + self.b(x2).relu()


def test_two_inputs_and_shared_side_by_side_params_are_exact() -> None:
    module, joins = TwoInputs(), pj.StageJoins()
    for mb in range(3):
        g = torch.Generator().manual_seed(10 + mb)
        xs = [torch.randn(4, 8, generator=g) for _ in range(2)]
        grad = torch.randn(4, 8, generator=g)
        want_in, want_p = plain(module, xs, grad)
        got_in, got_p, used = split(joins, module, xs, grad)
        assert used
        assert same(got_in, want_in) and same(got_p, want_p)


class Branchy(nn.Module):
    """A graph whose structure depends on the data (an extra op on some microbatches)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(8))
        self.extra = False

    def forward(self, x: Any) -> Any:
        h = torch.tanh(self.a(x))
        if self.extra:
            h = h * self.scale  # a new join on the chain
        return self.b(h)


def test_a_changed_graph_is_walked_again_and_stays_exact(monkeypatch: Any) -> None:
    counted = Counted(monkeypatch)
    module, joins = Branchy(), pj.StageJoins()
    for mb, extra in enumerate((False, False, True, True, False)):
        module.extra = extra
        split_equals_plain(module, joins, seed=20 + mb)
    assert counted.walks == 3  # the first, and each change of structure


class Swapped(nn.Module):
    """The same graph shape whichever parameter a microbatch uses: only the parameters'
    accumulators tell the graphs apart."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a = nn.Linear(8, 8)
        self.p1, self.p2 = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))
        self.second = False

    def forward(self, x: Any) -> Any:
        return torch.tanh(self.a(x)) * (self.p2 if self.second else self.p1)


def split_equals_plain(module: nn.Module, joins: Any, seed: int, planned: bool = True) -> None:
    """One microbatch through the joins' split backward equals the plain one, bit for bit
    (parameters the microbatch did not use get no gradient on either side); ``planned``:
    W ran from the joins (else whether it did is not checked)."""
    g = torch.Generator().manual_seed(seed)
    x, grad = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    want_in, want_p = plain(module, [x], grad)
    got_in, got_p, used = split(joins, module, [x], grad)
    assert (used or not planned) and same(got_in, want_in)
    assert [p is None for p in got_p] == [p is None for p in want_p]
    assert same([p for p in got_p if p is not None], [p for p in want_p if p is not None])


def test_a_graph_with_other_parameters_is_walked_again(monkeypatch: Any) -> None:
    counted = Counted(monkeypatch)
    module, joins = Swapped(), pj.StageJoins()
    for mb, second in enumerate((False, True, True, False)):
        module.second = second
        split_equals_plain(module, joins, seed=40 + mb)
    assert counted.walks == 3


class Reused(nn.Module):
    """One Linear twice on the chain: its two joins are nested, so no plan."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(8, 8)

    def forward(self, x: Any) -> Any:
        return self.a(torch.tanh(self.a(x)))


class Detached(nn.Module):
    """An output that does not depend on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 8))

    def forward(self, x: Any) -> Any:
        return self.w * 2 + 0 * x.detach()


class Unused(nn.Module):
    """A second input the output does not use."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: Any, y: Any) -> Any:
        return self.a(x)


@pytest.mark.parametrize("cls", [Reused, Detached, Unused])
def test_graphs_it_cannot_handle_fall_back_exactly(cls: type) -> None:
    module, joins = cls(), pj.StageJoins()
    n = 2 if cls is Unused else 1
    for mb in range(2):
        g = torch.Generator().manual_seed(30 + mb)
        xs = [torch.randn(4, 8, generator=g) for _ in range(n)]
        grad = torch.randn(4, 8, generator=g)
        ins = [x.detach().requires_grad_() for x in xs]
        y = module(*ins)
        params = list(module.parameters())
        assert joins.edges(0, [y], ins, lambda p=params: p) is None
        assert pj.analyse([y.grad_fn], ins, params) is None
        if cls is Reused:
            want_in, want_p = plain(module, xs, grad)
            got_in, got_p, used = split(joins, module, xs, grad)
            assert not used and same(got_p, want_p) and same(got_in, want_in)


def test_no_parameters_or_no_inputs_have_no_plan() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.tanh(x)
    assert pj.analyse([y.grad_fn], [x], []) is None
    lin = nn.Linear(8, 8)
    assert pj.analyse([lin(x).grad_fn], [], list(lin.parameters())) is None
    halves = lin(x).chunk(2)  # two outputs of one node
    assert pj.analyse([h.grad_fn for h in halves], [x], list(lin.parameters())) is None


class Widened(nn.Module):
    """A parameter branch that takes a second parameter on some microbatches (created
    before any node the plan records, so only the branch's edge count tells)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a = nn.Linear(8, 8)
        self.w1, self.w2 = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))
        self.both = False

    def forward(self, x: Any) -> Any:
        scale = self.w1 + self.w2 if self.both else self.w1 + self.w1.detach()
        return torch.tanh(self.a(x)) * scale


def test_a_parameter_branch_that_widens_is_walked_again(monkeypatch: Any) -> None:
    counted = Counted(monkeypatch)
    module, joins = Widened(), pj.StageJoins()
    for mb, both in enumerate((False, True, False)):
        module.both = both
        split_equals_plain(module, joins, seed=50 + mb)
    assert counted.walks == 3


class Switched(nn.Module):
    """A node on the input's chain whose second operand is a parameter on some microbatches
    and a buffer on others: the same types and the same number of edges either way, only
    where the edge leads tells (it becomes a join). ``deep``: that node is inside the stage,
    not its output's node."""

    def __init__(self, deep: bool) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.a, self.c = nn.Linear(8, 8), nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8))
        self.register_buffer("b", torch.randn(8))
        self.deep, self.use = deep, False

    def forward(self, x: Any) -> Any:
        h = torch.tanh(self.a(x)) * (self.w if self.use else self.b)
        return self.c(h) if self.deep else h


@pytest.mark.parametrize("deep", [False, True])
def test_a_chain_node_that_gains_a_parameter_is_walked_again(monkeypatch: Any, deep: bool) -> None:
    counted = Counted(monkeypatch)
    module, joins = Switched(deep), pj.StageJoins()
    for mb, use in enumerate((False, True, True, False)):
        module.use = use
        split_equals_plain(module, joins, seed=70 + mb)  # w gets its gradient when used
    assert counted.walks == 3


class Shared(nn.Module):
    """One activation used twice, or the same computation done twice: the same types and
    edges per node, but one node reached from two places or two nodes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.a = nn.Linear(8, 8)
        self.w1, self.w2 = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))
        self.twice = False

    def forward(self, x: Any) -> Any:
        h = self.a(x)
        g = self.a(x) if self.twice else h
        return torch.tanh(h) * self.w1 + torch.tanh(g) * self.w2


def test_a_node_shared_or_not_is_told_apart(monkeypatch: Any) -> None:
    counted = Counted(monkeypatch)
    module, joins = Shared(), pj.StageJoins()
    for mb, twice in enumerate((False, True, False)):
        module.twice = twice  # twice: nested joins sharing a parameter, so the plain W
        split_equals_plain(module, joins, seed=80 + mb, planned=not twice)
    assert counted.walks == 3
