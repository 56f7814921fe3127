"""The optional C++ extension ``_torch_facts`` (a tensor's facts read from torch's C++ tensor for the kernel's
``TensorRows``, ``RecordText`` and ``GradText``; the dump's node hooks put in without handles): rows, monitor CSV
bytes, record texts and dump files the same with its capsule and without it (the readers then ask torch's Python
API, the hooks go through ``register_hook``), its capsule exported only under the torch it was built for, nothing of
it used with ``MSPROBE_FAST_STATS=0``. The route comparisons pass where the extension is
not built too (both routes are then the Python API's); the tests of the capsule itself are skipped there."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from msprobe_core.stats.kernel import KERNEL

try:
    from msprobe_core.stats import _torch_facts
except ImportError:  # not built (no torch or no C++ compiler at install)
    _torch_facts = None

ROOT = Path(__file__).resolve().parents[3]
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the one-pass kernel is not built")
needs_facts = pytest.mark.skipif(getattr(_torch_facts, "FACTS", None) is None,
                                 reason="the C++ extension _torch_facts is not built (or built for another torch)")

# Every line of the scripts below starts by blocking the extension's import where argv[1] is "off", so that
# TensorRows asks torch's Python API (the route without the capsule); it prints whether the capsule was there.
_PRELUDE = r"""
import sys
if sys.argv[1] == "off":
    sys.modules["msprobe_core.stats._torch_facts"] = None
"""
_EPILOGUE = r"""
facts = sys.modules.get("msprobe_core.stats._torch_facts")
print(json.dumps(facts is not None and hasattr(facts, "FACTS")))
"""

_ROWS = _PRELUDE + r"""
import json, torch
from msprobe_core.monitor.stats import StatsEngine
g = torch.Generator().manual_seed(0)
def r(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)
emptied = r(4)
emptied.untyped_storage().resize_(0)
with torch.inference_mode():
    inference = r(5)
with torch.no_grad():
    sub = r(3).as_subclass(type("Sub", (torch.Tensor,), {}))
plain = [r(3, 4), torch.nn.Parameter(r(5)), r(6, dtype=torch.float64), r(7, dtype=torch.bfloat16), r(6)[2:],
         inference, r(2, 1, 3).transpose(0, 1)]
odd = [r(4, 3).t(), r(8)[::2], r(4, dtype=torch.float16), torch.arange(4), torch.zeros(4, dtype=torch.bool),
       torch._neg_view(r(4)), torch._efficientzerotensor(4), sub, r(2, 2).to_sparse(), torch.empty(3, device="meta"),
       torch.empty(0), r(0, 3), emptied, torch._to_functional_tensor(r(4)), torch.complex(r(3), r(3)),
       torch.nested.nested_tensor([r(2), r(3)])]
rows = StatsEngine(["min", "max", "norm", "mean", "zeros", "nans"], 1e-3).tensor_rows
out = []
for t in plain + odd:
    raw = bytearray()
    out.append([rows.row(raw, t, 1e-3, 1), raw.hex()])
raw = bytearray()
out.append([rows.rows(raw, plain, 1e-3, 1), raw.hex(), rows.rows(raw, plain + odd[:1], 1e-3, 1), raw.hex()])
print(json.dumps(out))
""" + _EPILOGUE

_MONITOR = _PRELUDE + r"""
import json, torch
from torch import nn
from msprobe_core.monitor.trainer_mon import TrainerMon
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8).to(torch.bfloat16))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
cfg = {"xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
       "ops": ["min", "max", "norm", "mean", "zeros", "nans"], "format": "csv", "eps": 1e-3}
mon = TrainerMon(cfg, output_dir=sys.argv[2])
mon.set_monitor(model, 1, opt)
g = torch.Generator().manual_seed(1)
losses = []
for step in range(4):
    x = torch.randn(4, 8, generator=g)
    y = model[:4](x)
    loss = nn.functional.mse_loss(model[4](y.to(torch.bfloat16)).float(), torch.randn(4, 8, generator=g))
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
mon.close()
print(json.dumps(losses))
""" + _EPILOGUE


_TEXTS = _PRELUDE + r"""
import json, torch
from msprobe_core.pytorch.summarize import Summarizer
g = torch.Generator().manual_seed(0)
def r(*shape, dtype=torch.float32):
    return (torch.randn(*shape, generator=g) * 4).to(dtype)
with torch.inference_mode():
    inference = r(5)
with torch.no_grad():
    sub = r(3).as_subclass(type("Sub", (torch.Tensor,), {}))
emptied = r(4)
emptied.untyped_storage().resize_(0)
objects = [r(3, 4), r(3, 4).t(), r(2, 3)[:, 1], r(4).half(), r(4, dtype=torch.bfloat16), r(6, dtype=torch.float64),
           torch.tensor(2.5), torch.zeros(0), r(0, 3), torch.arange(5), torch.tensor([True, False]),
           torch.nn.Parameter(r(5)), r(3).requires_grad_(), torch._neg_view(r(4)), torch._efficientzerotensor(3),
           r(*[1] * 17), inference, sub, emptied, torch._to_functional_tensor(r(4)), torch.empty(2, device="meta"),
           r(2, 2).to_sparse(), torch.complex(r(3), r(3)), [r(2), 1.5, {"k": r(1)}]]
out = []
for statistics in (True, False):
    s = Summarizer(statistics=statistics, md5=False)
    with torch.no_grad():
        for obj in objects:
            out.append([s.text(obj), s.text(obj)])
            if isinstance(obj, torch.Tensor):
                out.append([s.record_text.tensor(obj), s.grad_text.text(obj, True), s.grad_text.text(obj, True)])
        t = r(4, 8)
        for change in (lambda t: t.mul_(2), lambda t: t.transpose_(0, 1), lambda t: t.unsqueeze_(0),
                       lambda t: t.squeeze_(0), lambda t: t.resize_(2, 8), lambda t: t.resize_(4, 8),
                       lambda t: t.as_strided_((8, 4), (1, 8)), lambda t: t.as_strided_((4, 8), (8, 1)),
                       lambda t: t.set_(t._neg_view()), lambda t: t.set_(r(4, 8)), lambda t: t.resize_(0),
                       lambda t: t.resize_(3).fill_(2), lambda t: t.requires_grad_(True)):
            change(t)
            out.append([s.text(t), s.text(t)])
print(json.dumps(out))
""" + _EPILOGUE

_DUMP = _PRELUDE + r"""
import json, os, torch
from torch import nn
from msprobe_core.pytorch import PrecisionDebugger
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8).to(torch.bfloat16))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
dbg = PrecisionDebugger({"task": "statistics", "dump_path": sys.argv[2], "level": sys.argv[3]})
g = torch.Generator().manual_seed(1)
losses = []
for step in range(3):
    dbg.start(model)
    x = torch.randn(4, 8, generator=g)
    y = model[:4](x.t().contiguous().t())
    loss = nn.functional.mse_loss(model[4](y.to(torch.bfloat16)).float(), torch.randn(4, 8, generator=g))
    loss.backward()
    opt.step()
    opt.zero_grad()
    dbg.stop()
    dbg.step()
    losses.append(loss.item())
print(json.dumps(losses))
""" + _EPILOGUE


def _run(script: str, *args: str, **env: str) -> list:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **env), check=True)
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-2:]]


@needs_kernel
def test_rows_are_the_same_with_and_without_the_capsule():
    (with_facts, used), (without, unused) = _run(_ROWS, "on"), _run(_ROWS, "off")
    assert not unused and used == (getattr(_torch_facts, "FACTS", None) is not None)
    assert with_facts == without
    plain = [row for row, _ in with_facts[:7]]
    # the odd ones: None but the last, a nested tensor, whose buffer the Python API's answers let the kernel read
    # (the C++ route declines it and leaves it to them)
    assert plain == [0] * 7 and all(row is None for row, _ in with_facts[7:-2]) and with_facts[-2][0] == 0
    assert with_facts[-1][0] == 0 and with_facts[-1][2] is None


@needs_kernel
def test_monitor_csv_bytes_are_the_same_with_and_without_the_capsule(tmp_path):
    made = {}
    for route in ("on", "off"):
        out = tmp_path / route
        losses, used = _run(_MONITOR, route, str(out))
        files = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*.csv"))}
        made[route] = (files, losses)
        assert used == (route == "on" and getattr(_torch_facts, "FACTS", None) is not None)
    assert made["on"] == made["off"] and len(made["on"][0]) >= 4 * 5


@needs_kernel
def test_record_texts_are_the_same_with_and_without_the_capsule():
    """RecordText and GradText read a tensor's version, address, shape and flags from the C++ tensor where the
    capsule is there: the same texts (the kernel's, or None for the Python route) as through torch's Python API,
    for plain tensors, odd ones (which the C++ tensor declines or torch refuses) and in-place changes."""
    (with_facts, used), (without, unused) = _run(_TEXTS, "on"), _run(_TEXTS, "off")
    assert not unused and used == (getattr(_torch_facts, "FACTS", None) is not None)
    assert with_facts == without


@needs_kernel
@pytest.mark.parametrize("level", ["L0", "L1", "mix"])
def test_dump_files_are_the_same_with_and_without_the_capsule(tmp_path, level):
    made = {}
    for route in ("on", "off"):
        out = tmp_path / route
        losses, used = _run(_DUMP, route, str(out), level)
        files = {re.sub(r"proc\d+", "proc", p.relative_to(out).as_posix()): p.read_bytes()
                 for p in sorted(out.rglob("*.json"))}  # (a folder per process id)
        made[route] = (files, losses)
        assert used == (route == "on" and getattr(_torch_facts, "FACTS", None) is not None)
    assert made["on"] == made["off"] and sum(name.endswith("dump.json") for name in made["on"][0]) == 3


def test_the_kill_switch_leaves_the_extension_alone(tmp_path):
    _, used = _run(_MONITOR, "on", str(tmp_path / "out"), MSPROBE_FAST_STATS="0")
    assert not used


@needs_facts
def test_the_capsule_is_exported_only_under_the_torch_it_was_built_for():
    built = _torch_facts.BUILT_FOR
    assert _torch_facts.version_matches(torch.__version__)
    assert _torch_facts.version_matches(built) and _torch_facts.version_matches(built + "+cu128")
    for other in (built + ".1", built + "a0+git1234", "1" + built, "", built[:-1], "2.0.0"):
        assert not _torch_facts.version_matches(other), other
    script = ("import sys, torch; torch.__version__ = '0.0.1'; import msprobe_core.stats._torch_facts as f; "
              "print(hasattr(f, 'FACTS'), f.BUILT_FOR)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.stdout.split() == ["False", built]


@needs_kernel
def test_rows_under_another_torch_version_take_the_python_route():
    """A module built for another torch exports no capsule: TensorRows then asks torch's Python API, with the
    same rows."""
    script = "import torch; torch.__version__ = '0.0.1'\n" + _ROWS
    (rows, used), (want, _) = _run(script, "on"), _run(_ROWS, "off")
    assert not used and rows == want
