"""Backward records' ``output`` holds the call's own input gradients (seed 003), at L0, L1 and mix.

Each expected gradient is computed independently with ``torch.autograd.grad`` on a copy of the graph in
which the call's input is a separate leaf that only that call uses. The dumps use the tensor task, so the
recorded gradients are compared exactly, not through their statistics.
"""

from __future__ import annotations

import json
import os
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dump_models import ResidualAttention, make_data, train_steps
from msprobe_core.pytorch import PrecisionDebugger


def dump(tmp_path, level, run, task="tensor"):
    """Run ``run()`` (forward and backward) in one dumped step; returns (dump.json's data, tensor loader)."""
    out = tmp_path / level
    dbg = PrecisionDebugger({"dump_path": str(out), "level": level, "task": task})
    model = run.model
    dbg.start(model)
    run()
    dbg.stop()
    dbg.step()
    rank_dir = out / "step0" / f"proc{os.getpid()}"
    data = json.loads((rank_dir / "dump.json").read_text())["data"]

    def grad(name, field="output", index=0):
        entry = data[name][field][index]
        return None if entry is None else torch.load(rank_dir / "dump_tensor_data" / entry["data_name"])

    return data, grad


def _job(model, fn):
    fn.model = model
    return fn


class LnResidual(nn.Module):
    """``x`` feeds both a layer_norm and the residual add around it (the issue's example)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(x + self.ln(x))


def _inputs(kind):
    torch.manual_seed(0)
    base = torch.randn(4, 8, requires_grad=True)
    x = base if kind == "leaf" else base * 1.5  # a leaf (AccumulateGrad edge) or a computed tensor
    return base, x, torch.randint(0, 3, (4,))


@pytest.mark.parametrize("level", ["L0", "L1", "mix"])
@pytest.mark.parametrize("kind", ["leaf", "computed"])
def test_layer_norm_records_its_own_gradient_not_the_total(tmp_path, level, kind):
    torch.manual_seed(1)
    model = LnResidual()
    base, x, y = _inputs(kind)
    data, grad = dump(tmp_path, level, _job(model, lambda: F.cross_entropy(model(x), y).backward()))
    # independently: layer_norm's input is a leaf of its own, the residual add's another
    a, b = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    own, other = torch.autograd.grad(F.cross_entropy(model.head(b + model.ln(a)), y), [a, b])
    total = own + other
    assert not torch.allclose(own, total)
    names = {"L0": ["Module.ln.LayerNorm.backward.0"], "L1": ["Functional.layer_norm.0.backward"]}
    names["mix"] = names["L0"] + names["L1"]
    for name in names[level]:
        assert torch.equal(grad(name), own), name
        assert data[name]["output"][0]["Norm"] == pytest.approx(own.norm().item(), rel=1e-6)
    if level != "L0":  # the add's own gradient for x is its output's gradient; layer_norm's weight and bias
        assert torch.equal(grad("Tensor.__add__.0.backward"), other)  # have one use: their whole gradient
        assert torch.equal(grad("Functional.layer_norm.0.backward", index=1), model.ln.weight.grad)
        assert torch.equal(grad("Functional.layer_norm.0.backward", index=2), model.ln.bias.grad)


@pytest.mark.parametrize("level", ["L1", "mix"])
def test_cross_entropy_reports_the_gradient_of_its_logits(tmp_path, level):
    """cross_entropy is log_softmax + nll_loss in autograd: the record holds the edge leaving the call."""
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))

    def run():
        logits = model(x)
        (F.cross_entropy(logits, y) + logits.pow(2).mean()).backward()  # the logits have a second use

    data, grad = dump(tmp_path, level, _job(model, run))
    logits = model(x).detach().requires_grad_()
    own, = torch.autograd.grad(F.cross_entropy(logits, y), logits)
    rec = data["Functional.cross_entropy.0.backward"]
    assert len(rec["output"]) == 2 and rec["output"][1] is None  # the integer target has no gradient
    assert torch.equal(grad("Functional.cross_entropy.0.backward"), own)
    assert torch.equal(grad("Functional.cross_entropy.0.backward", "input"), torch.tensor(1.0))


def test_module_with_a_parameter_and_a_shared_weight(tmp_path):
    """L0: a Linear's record holds its input's own gradient; L1: a weight used by two calls gets each
    call's share (its edge to the weight's AccumulateGrad), parameters_grad the weight's total."""
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            h = self.lin(x)
            return F.linear(torch.tanh(h) + x, self.lin.weight)  # x reused; the weight used twice

    model = Tied()
    x = torch.randn(5, 6, requires_grad=True)
    for level in ("L0", "L1"):
        model.zero_grad()
        data, grad = dump(tmp_path, level, _job(model, lambda: model(x).pow(2).sum().backward()))
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        w1, w2 = model.lin.weight.detach().clone().requires_grad_(), model.lin.weight.detach().clone().requires_grad_()
        loss = F.linear(torch.tanh(F.linear(xa, w1, model.lin.bias)) + xb, w2).pow(2).sum()
        own_x, own_w1, own_w2 = torch.autograd.grad(loss, [xa, w1, w2])
        if level == "L0":
            assert torch.equal(grad("Module.lin.Linear.backward.0"), own_x)
            assert torch.equal(grad("Module.lin.Linear.parameters_grad.0", "weight"), model.lin.weight.grad)
        else:
            assert torch.equal(grad("Functional.linear.0.backward"), own_x)
            assert torch.equal(grad("Functional.linear.0.backward", index=1), own_w1)
            assert torch.equal(grad("Functional.linear.1.backward", index=1), own_w2)
            assert not torch.equal(own_w1, model.lin.weight.grad)
        PrecisionDebugger.reset()


class UsesTwice(nn.Module):
    def forward(self, x):
        return x * x + x.sin()  # three edges to x inside the call, from two nodes


@pytest.mark.parametrize("level", ["L0", "L1"])
def test_input_used_several_times_inside_the_call_gets_their_sum(tmp_path, level):
    torch.manual_seed(0)
    model = nn.Sequential(UsesTwice())
    x = torch.randn(3, 4) * 1.0
    x.requires_grad_()
    data, grad = dump(tmp_path, level, _job(model, lambda: (model(x) * 3 + x).sum().backward()))
    a = x.detach().clone().requires_grad_()
    own, = torch.autograd.grad((UsesTwice()(a) * 3).sum(), a)
    if level == "L0":
        torch.testing.assert_close(grad("Module.0.UsesTwice.backward.0"), own, rtol=1e-6, atol=0)
        assert not torch.allclose(own, x.grad)
    else:  # x * x: both inputs are x, each gets the call's whole gradient for x
        mul = a.detach().clone().requires_grad_()
        own_mul, = torch.autograd.grad((mul * mul * 3).sum(), mul)
        torch.testing.assert_close(grad("Tensor.__mul__.0.backward", index=0), own_mul, rtol=1e-6, atol=0)
        torch.testing.assert_close(grad("Tensor.__mul__.0.backward", index=1), own_mul, rtol=1e-6, atol=0)


@pytest.mark.parametrize("level", ["L0", "L1"])
def test_outputs_of_one_node_count_its_edge_once(tmp_path, level):
    """split's three outputs share one graph node: its edge to the input is counted once, not per output."""

    class Split(nn.Module):
        def forward(self, x):
            return x.split(2, dim=-1)

    model = nn.Sequential(Split())
    x = (torch.randn(3, 6) * 1.0).requires_grad_()
    weights = torch.tensor([1.0, 2.0, 3.0])

    def run():
        pieces = model(x)
        (sum(w * p.sum() for w, p in zip(weights, pieces)) + x.sum()).backward()

    data, grad = dump(tmp_path, level, _job(model, run))
    own = weights.repeat_interleave(2).expand(3, 6)
    name = "Module.0.Split.backward.0" if level == "L0" else "Tensor.split.0.backward"
    assert torch.equal(grad(name), own)


def test_an_output_the_loss_does_not_use_sends_nothing(tmp_path):
    """x reaches the call's two outputs; only one is in the loss: the other branch's nodes never run and the
    record (completed when the backward pass ends) holds the branch that did."""
    torch.manual_seed(0)

    class TwoHeads(nn.Module):
        def forward(self, x):
            return x.sin() * 2, x.cos()

    model = nn.Sequential()
    model.add_module("heads", TwoHeads())
    x = (torch.randn(3, 4) * 1.0).requires_grad_()
    data, grad = dump(tmp_path, "L0", _job(model, lambda: model.heads(x)[0].sum().backward()))
    assert torch.equal(grad("Module.heads.TwoHeads.backward.0"), x.detach().cos() * 2)


def test_in_place_call_and_pass_through_module(tmp_path):
    """An in-place relu reports the gradient of its input's version before the call; a Dropout in eval mode
    returns its input: its input's gradient is its output's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    x = torch.randn(3, 4)

    def run():
        h = model(x)
        F.relu(h, inplace=True)
        (h * torch.arange(4.0)).sum().backward()

    for level in ("L1", "L0"):
        data, grad = dump(tmp_path, level, _job(model, run))
        h = model(x).detach()
        if level == "L1":
            assert torch.equal(grad("Functional.relu.0.backward"), (h > 0) * torch.arange(4.0))
        else:
            assert torch.equal(grad("Module.1.Dropout.backward.0"), grad("Module.1.Dropout.backward.0", "input"))
        PrecisionDebugger.reset()


def test_inputs_and_outputs_without_grad(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(2, 4)  # does not require grad

    def run():
        out = model(x)
        torch.argmax(out, dim=1)  # an output without grad: no backward record
        out.sum().backward()

    data, grad = dump(tmp_path, "L1", _job(model, run))
    assert not any(k.startswith("Torch.argmax") and k.endswith("backward") for k in data)
    rec = data["Functional.linear.0.backward"]
    assert rec["output"][0] is None and rec["output"][1] is not None  # x has no gradient, the weight has


@pytest.mark.parametrize("level", ["L0", "L1", "mix"])
def test_losses_and_gradients_bit_identical(tmp_path, level):
    def run(dbg):
        torch.manual_seed(0)
        model = ResidualAttention()
        hooks = {} if dbg is None else {"before": lambda i: dbg.start(model), "after": lambda i: (dbg.stop(), dbg.step())}
        return train_steps(model, make_data(), 2, **hooks)

    ref_losses, ref_grads = run(None)
    losses, grads = run(PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": level}))
    assert losses == ref_losses
    assert all(torch.equal(a, b) for g, r in zip(grads, ref_grads) for a, b in zip(g, r))


def test_hooks_end_with_the_step_and_hold_no_graph(tmp_path):
    """A backward run after step() records nothing into the next step, and the tool keeps no graph alive."""
    torch.manual_seed(0)
    model = LnResidual()
    x = torch.randn(4, 8, requires_grad=True)
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "mix"})
    dbg.start(model)
    out = model(x)
    dbg.stop()
    dbg.step()
    assert not dbg.service._step_handles
    dbg.start(model)
    out.sum().backward()  # the graph of step 0
    dbg.stop()
    dbg.step()
    step1 = json.loads((tmp_path / "d" / "step1" / f"proc{os.getpid()}" / "dump.json").read_text())["data"]
    assert set(step1) == {"Tensor.sum.0.forward", "Tensor.sum.0.backward"}  # only the call made in step 1
    dbg.start(model)
    h = x * 2
    out = model(h)
    refs = [weakref.ref(out), weakref.ref(h)]
    out.sum().backward()
    del out, h
    assert all(r() is None for r in refs)  # freed by reference counting: no cycle through the hooks
    dbg.stop()
    dbg.step()
