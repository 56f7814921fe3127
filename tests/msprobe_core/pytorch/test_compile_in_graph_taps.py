"""The torch behaviour an in-graph path for activation statistics on compiled models would rest on (evaluated
for issue 27, not used by the tool yet): under the default backend (Inductor) any graph break changes the
kernels, so the tool's graph breaks change the last bits of the losses (``test_compile.py``). Statistics
computed *inside* the graph change nothing:

* forward: a module hook that Dynamo traces (no ``torch.compiler.disable``) and appends a stacked statistics
  tensor to a list: Dynamo replays the append after the graph, the statistics are extra graph outputs;
* backward: an identity ``autograd.Function`` on the hooked output whose backward returns the statistics of
  the incoming gradient as the gradient of a "sink" leaf tensor: no side effect in the backward graph (Dynamo
  refuses one in an in-graph ``register_hook``: "HOP: Unsafe side effect"), the statistics arrive as
  ``sink.grad``.

Zero graph breaks, one graph for every step, losses bit-identical to the compiled model without hooks, and the
statistics those of an eager run. If this test fails on a newer torch, that path is closed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

pytestmark = pytest.mark.slow  # compiles with Inductor (seconds)


def stats(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.norm(), t.amax(), t.amin(), t.mean()])


class Tap(torch.autograd.Function):
    """Identity forward (a copy, not a view: the user may modify the output in place); backward hands the
    gradient on untouched and its statistics to the sink."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, stats(grad)


def model(inplace: bool = False) -> nn.Module:
    torch.manual_seed(0)  # an in-place ReLU modifies the tapped output of the first Linear
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=inplace), nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 4))


def train(m: nn.Module, steps: int, each_step=None) -> list[float]:
    torch.manual_seed(1)
    data = [torch.randn(4, 5, 8) for _ in range(steps)]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for x in data:
        opt.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if each_step:
            each_step()
    return losses


def tap_every_module(m: nn.Module, forward: list) -> dict:
    """A traced forward hook on each module: forward statistics appended to ``forward``, the output tapped;
    returns {module: its sink}."""
    sinks = {mod: torch.zeros(4, requires_grad=True) for mod in m}

    def hook(mod, args, out):
        forward.append(stats(out.detach()))
        return Tap.apply(out, sinks[mod])

    for mod in m:
        mod.register_forward_hook(hook)
    return sinks


def test_statistics_inside_the_graph_leave_inductor_losses_bit_identical():
    torch._dynamo.reset()
    plain = train(torch.compile(model()), 4)

    # eager reference statistics (tensor hooks) of the first step
    eager = model()
    want_fwd, want_bwd = [], []

    def watch(_m, _a, out):
        want_fwd.append(stats(out.detach()))
        out.register_hook(lambda g: want_bwd.append(stats(g)))

    for mod in eager:
        mod.register_forward_hook(watch)
    train(eager, 1)

    torch._dynamo.reset()
    counters.clear()
    forward: list[torch.Tensor] = []
    tapped = model()
    sinks = tap_every_module(tapped, forward)
    got_fwd, got_bwd = [], []

    def collect():
        got_fwd.append(list(forward))
        got_bwd.append([s.grad.clone() for s in sinks.values()])
        forward.clear()
        for s in sinks.values():
            s.grad = None

    losses = train(torch.compile(tapped), 4, collect)
    assert losses == plain
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    for got, want in ((got_fwd[0], want_fwd), (got_bwd[0], want_bwd[::-1])):  # backward runs last module first
        assert len(got) == len(want) == 5
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_a_tapped_output_may_be_modified_in_place():
    torch._dynamo.reset()
    plain = train(torch.compile(model(inplace=True)), 3)
    torch._dynamo.reset()
    counters.clear()
    tapped = model(inplace=True)
    tap_every_module(tapped, [])
    assert train(torch.compile(tapped), 3) == plain
    assert sum(counters["graph_break"].values()) == 0
