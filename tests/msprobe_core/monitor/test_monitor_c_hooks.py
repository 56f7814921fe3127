"""The activation hooks' C route (the kernel's ``ForwardSite`` and ``Activation``, ``module_hooks``) against their
Python route: the same CSV bytes, alerts, metrics and losses for a run mixing the usual call with every other kind
(a module called twice, tuple outputs, keywords, a non-float input, a strided view, eval mode, gradient
checkpointing, a NaN injected), and no object left behind by a long loop of hooked calls."""

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
from msprobe_core.monitor import module_hooks
from msprobe_core.monitor.trainer_mon import TrainerMon
if sys.argv[2] == "py":
    module_hooks._ActivationCore = None


class Pair(nn.Module):
    def forward(self, x):
        return x * 2, x.t()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.pair, self.frozen = nn.Linear(8, 8), nn.GELU(), Pair(), nn.Linear(8, 8).eval()
        self.idx = nn.Embedding(10, 8)
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def forward(self, x, step):
        h = self.act(self.fc(x))
        h = self.act(h)  # the same module twice: .call1
        a, b = self.pair(h)
        h = a + b.t() + self.idx(torch.arange(x.shape[0]) % 10)  # an int input
        h = self.fc(input=h)  # keywords
        h = self.act(h.t()).t()  # a strided view in
        h = h + self.frozen(h)  # eval mode: skipped
        h = checkpoint(self.inner, h, use_reentrant=False)  # recomputed in backward: not recorded twice
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
    for name in ("0.fc.output", "0.act.call1.output", "0.pair.output.0", "0.inner.0.input", "4.output"):
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
