"""L0 module calls whose output's gradient comes from the call's own autograd node (``backward_capture``):
the same records as tensor hooks on the outputs would make, the gradient the call receives when a user's
hook changes it, hooks gone with the step, and nothing lost when the process dies mid-backward."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from msprobe_core.pytorch import PrecisionDebugger, backward_capture
from msprobe_core.pytorch.dump_service import DumpService

ROOT = Path(__file__).resolve().parents[3]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.GELU())], nn.Linear(8, 3))


def _dump_files(out: Path, model: nn.Module, steps: int = 2, before_backward=None) -> list[dict[str, str]]:
    """Train ``model`` ``steps`` steps under an L0 statistics dump; each step's JSON files as text."""
    dbg = PrecisionDebugger({"dump_path": str(out), "level": "L0", "task": "statistics"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        dbg.start(model)
        loss = model(torch.randn(4, 8, generator=gen)).square().mean()
        if before_backward is not None:
            before_backward(dbg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dbg.stop()
        dbg.step()
    return [{f.name: f.read_text() for f in next((out / f"step{i}").iterdir()).glob("*.json")} for i in range(steps)]


def test_records_are_those_of_tensor_hooks_byte_for_byte(tmp_path, monkeypatch):
    """Node hooks and the uncached gradient text make the records that tensor hooks and ``tensor_text`` make."""
    fast = _dump_files(tmp_path / "fast", _mlp())
    monkeypatch.setattr(DumpService, "_grads_by_node", lambda self, module: False)

    def python_text(dbg):  # the cached Python text route for every gradient
        dbg.service.records._grad_text = None

    slow = _dump_files(tmp_path / "slow", _mlp(), before_backward=python_text)
    for a, b in zip(fast, slow):  # (stack.json: the two runs are called from two lines of this test)
        assert a["dump.json"] == b["dump.json"] and a["construct.json"] == b["construct.json"]
    data = json.loads(fast[1]["dump.json"])["data"]
    assert data["Module.0.Linear.backward.0"]["input"][0]["Max"] is not None
    assert data["Module.2.Linear.backward.0"]["output"][0]["Max"] is not None


class _DoubledAfterwards(nn.Module):
    """The user's code doubles the gradient of ``lin``'s output by a hook registered after the call returned
    (after the dump's forward hooks: a tensor hook of the dump's own would see the gradient before it)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)  # ``lin``'s input requires grad: ``lin`` has a node with an edge to it
        self.lin = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.lin(self.pre(x))
        h.register_hook(lambda g: g * 2)
        return self.head(self.act(h))


def test_the_recorded_output_gradient_is_the_one_the_call_receives(tmp_path):
    """A module's backward ``input`` is the gradient its backward receives, after every hook on its output:
    here the doubled one; the next module's ``output`` (what it sends) is the gradient before the hook."""
    torch.manual_seed(0)
    files = _dump_files(tmp_path / "d", _DoubledAfterwards(), steps=1)
    data = json.loads(files[0]["dump.json"])["data"]
    received = data["Module.lin.Linear.backward.0"]["input"][0]
    sent = data["Module.act.GELU.backward.0"]["output"][0]
    for stat in ("Max", "Min", "Mean", "Norm"):  # doubling is exact in floating point
        assert received[stat] == 2 * sent[stat]


def test_node_hooks_end_with_the_step(tmp_path):
    """A graph made in one step and run backward in the next (retained) records nothing into the next step;
    no hook of the dump stays on the parameters."""
    model = _mlp()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L0", "task": "statistics"})
    dbg.start(model)
    loss = model(torch.randn(4, 8)).sum()
    dbg.stop()
    dbg.step()
    assert not dbg.service._step_handles
    dbg.start(model)
    loss.backward()
    dbg.stop()
    dbg.step()
    assert all(not p._backward_hooks for p in model.parameters())
    step1 = tmp_path / "d" / "step1"
    assert not step1.exists() or not any(
        name for d in step1.iterdir() for name in json.loads((d / "dump.json").read_text())["data"])


KILLED = textwrap.dedent("""
    import os, signal, sys, torch
    import torch.nn as nn
    from msprobe_core.pytorch import PrecisionDebugger

    class Die(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            if {kill}:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-backward: the layers after this one are done
            return g

    class Stop(nn.Module):
        def forward(self, x):
            return Die.apply(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), Stop(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))
    dbg = PrecisionDebugger({{"dump_path": {out!r}, "level": "L0", "task": "statistics"}})
    dbg.start(model)
    model(torch.randn(4, 8)).square().mean().backward()
    dbg.stop()
    dbg.step()
""")


def test_a_kill_mid_backward_keeps_the_gradients_recorded(tmp_path):
    """SIGKILL inside the backward: every backward record of the layers whose backward ran is recovered, as
    a run that goes on writes it."""
    runs = {}
    for kill in (True, False):
        out = tmp_path / ("killed" if kill else "full")
        proc = subprocess.run([sys.executable, "-c", KILLED.format(kill=kill, out=str(out))], capture_output=True,
                              text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert proc.returncode == (-signal.SIGKILL if kill else 0), proc.stderr
        runs[kill] = out
    res = subprocess.run([sys.executable, "-m", "msprobe_core", "recover", str(runs[True])], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr
    got, want = (json.loads((next((runs[k] / "step0").iterdir()) / "dump.json").read_text())["data"]
                 for k in (True, False))
    done = ["Module.5.Linear.backward.0", "Module.4.GELU.backward.0", "Module.3.Linear.backward.0",
            "Module.5.Linear.parameters_grad.0"]
    for name in done:
        assert got[name] == want[name]
    assert "Module.0.Linear.backward.0" not in got and "Module.0.Linear.backward.0" in want
    assert [n for n in got if n.endswith(".forward.0")] == [n for n in want if n.endswith(".forward.0")]


@pytest.mark.parametrize("level", ["L0", "mix"])
def test_losses_and_gradients_bit_identical_with_node_hooks(tmp_path, level):
    def run(dbg):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(2):
            if dbg is not None:
                dbg.start(model)
            loss = model(torch.randn(4, 8, generator=gen)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if dbg is not None:
                dbg.stop()
                dbg.step()
        return losses, [p.detach().clone() for p in model.parameters()]

    ref_losses, ref_params = run(None)
    losses, params = run(PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": level}))
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def _graphs():
    """(inputs, function) pairs whose graphs the walk meets: one node, several, a leaf input, an input used
    twice, outputs of one node, an output that is its input's view."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    leaf = torch.randn(3, 4, requires_grad=True)
    made = leaf * 1.5
    yield [made], lambda: lin(made)
    yield [leaf], lambda: lin(leaf)
    yield [made], lambda: made * made + made.sin()
    yield [made, leaf], lambda: torch.cat([made, leaf]).chunk(2)
    yield [made], lambda: nn.functional.cross_entropy(made, torch.tensor([0, 1, 2]))
    yield [leaf, made], lambda: (leaf + made).view(-1)


@pytest.mark.skipif(backward_capture._walk_fast is None, reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
def test_the_compiled_walk_finds_what_the_python_walk_finds():
    for inputs, fn in _graphs():
        edges = backward_capture.InputEdges.of(inputs)
        out = fn()
        outs = list(out) if isinstance(out, tuple) else [out]
        end = torch._C._autograd._get_sequence_nr()
        roots = [t.grad_fn for t in outs if t.grad_fn is not None]
        for skip in ({}, dict.fromkeys(list(edges.slots)[:1])):
            args = (roots, edges.slots, skip, edges.begin, end, edges.leaf)
            assert backward_capture._walk_fast(*args, backward_capture.ACCUMULATE_GRAD) \
                == backward_capture._walk(*args)
            assert backward_capture._walk(*args)[0] or skip
