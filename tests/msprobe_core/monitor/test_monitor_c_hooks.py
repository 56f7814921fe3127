"""The monitor's C routes (the kernel's ``ForwardSite`` and ``Activation``, ``module_hooks``; ``state_rows``,
``collector``) against their Python routes: the same CSV bytes, alerts, metrics and losses for a run mixing the usual
call with every other kind (a module called twice, tuple outputs, keywords, a non-float input, a strided view, eval
mode, gradient checkpointing, a NaN injected, a transposed and an empty parameter, an input the Python route
knows, an activation changed in place between two modules), and no object left behind by a
long loop of hooked calls or batches."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from msprobe_core.monitor import module_hooks
from msprobe_core.stats.kernel import KERNEL

needs_kernel = pytest.mark.skipif(KERNEL is None or not hasattr(KERNEL, "ForwardSite"),
                                  reason="the one-pass kernel is not built")

_RUN = r"""
import json, sys, torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from msprobe_core.monitor import collector, module_hooks
from msprobe_core.monitor.trainer_mon import TrainerMon
if sys.argv[2] == "py":
    module_hooks._ActivationCore = None
    collector._state_rows = None


class Pair(nn.Module):
    def forward(self, x):
        return x * 2, x.t()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.pair, self.frozen = nn.Linear(8, 8), nn.GELU(), Pair(), nn.Linear(8, 8).eval()
        self.idx = nn.Embedding(10, 8)
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.turned = nn.Parameter(torch.randn(8, 8).t())  # not contiguous: its batch takes the Python route
        self.empty = nn.Parameter(torch.empty(0))  # no elements: so does its

    def forward(self, x, step):
        h = self.act(self.fc(x))
        h = self.act(h)  # the same module twice: .call1
        a, b = self.pair(h)
        a = self.act(a)  # an input the Python route knows (a tuple's leaf): asked again, not taken as known
        h = a + b.t() + self.idx(torch.arange(x.shape[0]) % 10)  # an int input
        h = self.fc(input=h)  # keywords
        h = self.act(h.t()).t()  # a strided view in
        h = h + self.frozen(h)  # eval mode: skipped
        h = checkpoint(self.inner, h, use_reentrant=False)  # recomputed in backward: not recorded twice
        h = h @ self.turned + self.empty.sum()
        return h


torch.manual_seed(0)
model = nn.Sequential(Block(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Identity())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
cfg = {"xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
       "ops": ["min", "max", "norm", "mean", "zeros", "nans"], "format": ["csv", "api"], "eps": 1e-3,
       "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]}}
mon = TrainerMon(cfg, output_dir=sys.argv[1])
mon.set_monitor(model, 2, opt)
g = torch.Generator().manual_seed(1)
losses = []


def forward(x):
    h = model[0](x, 0)
    for m in model[1:]:
        h = m(h)
        if m is model[3]:
            h.mul_(1.0)  # changed in place after it was seen: the next module's input is a new activation
    return h


model.forward = forward
for step in range(6):
    for _ in range(2):
        x = torch.randn(4, 8, generator=g)
        if step == 4:
            x[0, 0] = float("nan")
        loss = nn.functional.mse_loss(model(x), torch.randn(4, 8, generator=g))
        loss.backward()
        losses.append(loss.item().hex())
    opt.step()
    opt.zero_grad()
print(json.dumps([[(a.step, a.kind, a.name, a.metric, a.rule) for a in mon.anomalies], mon.get_metrics(), losses]))
mon.close()
"""


@needs_kernel
def test_the_c_hooks_write_what_the_python_hooks_write(tmp_path):
    made = {}
    for route in ("c", "py"):
        out = tmp_path / route
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        done = subprocess.run([sys.executable, "-c", _RUN, str(out), route], env=env, capture_output=True, text=True,
                              check=True)
        files = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(Path(out).rglob("*.csv"))}
        made[route] = (files, json.loads(done.stdout.strip().splitlines()[-1]))
    (c_files, c_out), (py_files, py_out) = made["c"], made["py"]
    assert c_files == py_files and len(c_files) >= 6 * 5
    assert c_out == py_out
    actv = b"".join(data for name, data in c_files.items() if "/actv_" in name).decode()
    for name in ("0.fc.output", "0.act.call1.output", "0.act.call2.input", "0.pair.output.0", "0.inner.0.input",
                 "4.input", "4.output"):
        assert name in actv
    assert "0.frozen" not in actv


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(8, 8), nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


@needs_kernel
def test_the_c_route_is_planned_at_install_and_leaves_nothing_behind(tmp_path):
    from msprobe_core.monitor.trainer_mon import TrainerMon

    model = _Model()
    mon = TrainerMon({"xy_distribution": True, "ops": ["min", "max"], "format": "csv"}, output_dir=str(tmp_path))
    mon.set_monitor(model, 1, torch.optim.SGD(model.parameters(), lr=0.0))
    hook = next(iter(model.fc._forward_hooks.values()))
    assert type(hook) is KERNEL.ForwardSite
    x = torch.randn(4, 8)

    def steps(n: int) -> None:
        for _ in range(n):
            model(x).sum().backward()
            mon._hooks.new_step(mon._hooks.state)  # the step's activations forgotten, as at a step's end
            mon.collector.reset()

    steps(200)
    model(x)
    activation = next(iter(mon._hooks._seen.values()))
    assert type(activation) is KERNEL.Activation and not gc.is_tracked(activation)
    gc.collect()
    tracked, blocks = len(gc.get_objects()), sys.getallocatedblocks()  # blocks: untracked objects too
    steps(2000)
    gc.collect()
    assert len(gc.get_objects()) <= tracked + 50 and sys.getallocatedblocks() <= blocks + 500
    mon.close()


@needs_kernel
def test_a_failing_c_hook_is_logged_once_and_the_step_goes_on(tmp_path, caplog):
    from msprobe_core.monitor.trainer_mon import TrainerMon

    model = _Model()
    mon = TrainerMon({"xy_distribution": True, "ops": ["min", "max"], "format": "csv"}, output_dir=str(tmp_path))
    mon.set_monitor(model, 1, torch.optim.SGD(model.parameters(), lr=0.0))
    mon._hooks._seen = []  # not the dict the C hook takes: it fails
    with caplog.at_level("ERROR", logger="msprobe_core.monitor"):
        out = model(torch.randn(4, 8))
        model(torch.randn(4, 8))
    assert out.shape == (4, 8)
    assert sum("activation hook of 'fc' failed" in r.getMessage() for r in caplog.records) == 1
    mon._hooks._seen = {}
    mon.close()


def test_without_the_kernel_the_python_hooks_go_in(monkeypatch, tmp_path):
    from msprobe_core.monitor.trainer_mon import TrainerMon

    monkeypatch.setattr(module_hooks, "_ActivationCore", None)
    model = _Model()
    mon = TrainerMon({"xy_distribution": True, "ops": ["min", "max"], "format": "csv"}, output_dir=str(tmp_path))
    mon.set_monitor(model, 1, torch.optim.SGD(model.parameters(), lr=0.0))
    hook = next(iter(model.fc._forward_hooks.values()))
    assert KERNEL is None or type(hook) is not getattr(KERNEL, "ForwardSite", None)
    model(torch.randn(4, 8)).sum().backward()
    assert type(next(iter(mon._hooks._seen.values()))) is module_hooks._Activation
    mon.close()


def _batch_by(route: str, tensors: list, micro: int | None = 1) -> tuple[bytes, list]:
    """``StepCollector.record_columns`` of ``tensors`` by the kernel's ``state_rows`` or by the Python route."""
    from msprobe_core.monitor import collector as collector_module
    from msprobe_core.monitor.collector import StepCollector
    from msprobe_core.monitor.stats import StatsEngine

    col = StepCollector(StatsEngine(["min", "max", "norm", "mean", "zeros", "nans"], 1e-3))
    col.slot(torch.ones(3))  # a row already there: the batch's rows come after it
    names = [f"p{i}" for i in range(len(tensors))]
    modules = [f"m{i}" for i in range(len(tensors))]
    saved = collector_module._state_rows
    if route == "py":
        collector_module._state_rows = None
    try:
        col.record_columns("param", names, modules, tensors, micro)
    finally:
        collector_module._state_rows = saved
    return bytes(col._raw), list(col._entries)


@needs_kernel
def test_state_rows_appends_what_the_python_route_appends():
    g = torch.Generator().manual_seed(3)
    plain = [torch.randn(64, 64, generator=g), torch.randn(5, generator=g).double(), nn.Parameter(torch.randn(7)),
             torch.randn(300_000, generator=g), torch.tensor([float("nan"), 0.0, float("inf")]),
             torch.randn(9, generator=g).bfloat16()]
    assert _batch_by("c", plain) == _batch_by("py", plain)
    assert _batch_by("c", plain, None) == _batch_by("py", plain, None)
    for odd in (torch.randn(8, 8).t(), torch.empty(0), torch.randn(4)[::2], torch.arange(4),
                torch.randn(3).as_subclass(type("Sub", (torch.Tensor,), {}))):
        assert _batch_by("c", plain + [odd]) == _batch_by("py", plain + [odd])


@needs_kernel
def test_state_rows_leaves_the_batch_to_python_where_it_does_not_read_a_tensor():
    from msprobe_core.monitor.stats import StatsEngine

    rows = StatsEngine(["min", "max"], 1e-3).tensor_rows
    raw, entries = bytearray(), []
    ok = [torch.randn(4)]
    for names, modules, tensors in ((["a"], ["m"], [torch.empty(0)]), (["a", "b"], ["m"], ok + ok),
                                    (["a"], ["m"], [torch.randn(4, 4).t()]), (["a"], ["m"], ["not a tensor"])):
        assert KERNEL.state_rows(rows, raw, entries, "param", names, modules, tensors, None, 1e-3, 1) is None
    assert raw == bytearray() and entries == []
    with pytest.raises(TypeError):
        KERNEL.state_rows(rows, b"", entries, "param", ["a"], ["m"], ok, None, 1e-3, 1)
    with pytest.raises(TypeError):
        KERNEL.state_rows(rows, raw, entries, "param", ["a"], ["m"], ok, None, 1e-3)
    assert KERNEL.state_rows(rows, raw, entries, "param", ["a"], ["m"], ok, None, 1e-3, 1) is True
    assert entries == ["param", "a", "m", None, 4, 0, False, False]


@needs_kernel
def test_state_rows_leaks_nothing():
    from msprobe_core.monitor.stats import StatsEngine

    rows = StatsEngine(["min", "max"], 1e-3).tensor_rows
    tensors, names, modules = [torch.randn(16) for _ in range(8)], [f"n{i}" for i in range(8)], ["m"] * 8
    raw, entries = bytearray(), []

    def loop(n: int) -> None:
        for _ in range(n):
            KERNEL.state_rows(rows, raw, entries, "grad", names, modules, tensors, 0, 1e-3, 1)
            KERNEL.state_rows(rows, raw, entries, "grad", names, modules, tensors[:-1] + [torch.empty(0)], 0, 1e-3, 1)
            del raw[:], entries[:]

    loop(1000)
    gc.collect()
    blocks = sys.getallocatedblocks()
    loop(20000)
    gc.collect()
    assert sys.getallocatedblocks() <= blocks + 200
