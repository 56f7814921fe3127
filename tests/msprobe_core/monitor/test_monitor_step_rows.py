"""A step's rows as columns (``StepRows``) and the kernel pieces behind them: ``raw_ops`` (the host rows' ops),
``csv_rows`` from a buffer of doubles, ``TensorRows`` (which tensors the kernel reads as they are), and a whole
run's CSV files the same with the kernel and without it (``MSPROBE_FAST_STATS=0``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from array import array
from pathlib import Path

import numpy as np
import pytest
import torch

from msprobe_core.monitor.records import MetricRow
from msprobe_core.monitor.stats import RAW_WIDTH, StatsEngine
from msprobe_core.monitor.step_rows import StepRows
from msprobe_core.stats.kernel import KERNEL

OPS = ("min", "max", "norm", "mean", "zeros", "nans")
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the one-pass kernel is not built")


def _rows() -> list[MetricRow]:
    return [MetricRow("actv", "a.output", "a", 0, 0, 4, (1.0, math.nan), external=True),
            MetricRow("actv", "b.input", "b", 0, 1, 4, (1.0, math.nan), alias=True),
            MetricRow("grad", "w", "m", None, 2, 9, (-math.inf, 1e-300))]


def test_rows_as_columns_give_back_the_rows():
    rows = _rows()
    cols = StepRows.of(rows)
    assert StepRows.of(cols) is cols and len(cols) == 3
    assert repr(list(cols)) == repr(rows) and cols[-1] == rows[-1] and repr(cols[1:]) == repr(rows[1:])
    assert all(type(r) is MetricRow and type(r.values) is tuple for r in cols)
    part = cols.where(~cols.layout.mask("alias"))
    assert [r.name for r in part] == ["a.output", "w"] and part.layout is cols.where(~cols.layout.mask("alias")).layout
    assert cols.take(np.arange(3)) is cols and StepRows.of([]) == []


@needs_kernel
def test_raw_ops_are_the_python_formulas_rounded_to_float32():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g) * 10.0 ** (n % 7 - 3) for n in (1, 5, 64, 4097)]
    tensors[1][2] = math.nan
    tensors[2][3] = math.inf
    tensors.append(torch.zeros(8))
    raw = bytearray()
    for t in tensors:
        KERNEL.append_row(raw, t.data_ptr(), t.numel(), 0, 1e-8, 1)
    rows = array("d")
    rows.frombytes(raw)
    codes = {"min": 0, "max": 1, "norm": 2, "mean": 3, "zeros": 4, "nans": 5}
    got = array("d", KERNEL.raw_ops(raw, [codes[op] for op in OPS]))
    for i in range(len(tensors)):
        r = rows[RAW_WIDTH * i:RAW_WIDTH * (i + 1)]
        want = array("f", [r[1], r[0], pow(r[3], 0.5), r[2] / r[6], r[4] / r[6], r[5]])
        assert repr(list(got[6 * i:6 * i + 6])) == repr(list(want))  # nan-aware and bit for bit


@needs_kernel
def test_csv_rows_from_a_buffer_of_doubles_writes_what_it_writes_from_floats():
    values = [0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 1e-300, 123456789.0, 3.4e38, 1e-45, 0.1, -2.5e-7]
    heads, tails = ["a,", '"b,c",'], [",0", ",-1"]
    want = KERNEL.csv_rows(heads, "9", tails, values, 6, 5)
    assert KERNEL.csv_rows(heads, "9", tails, np.array(values), 6, 5) == want
    assert KERNEL.csv_rows(heads, "9", tails, array("d", values), 6, 5) == want
    # a line with the values of the line before (an alias) reuses its text, also past the text's first buffer
    for width in (3, 60):
        line = [1.0 / 3.0 * 10.0 ** (i % 30 - 15) for i in range(width)]
        rows = line * 3 + [-x for x in line] + line * 40
        many = [f"r{i}," for i in range(len(rows) // width)]
        assert KERNEL.csv_rows(many, "2", None, np.array(rows), width, 6) == KERNEL.csv_rows(many, "2", None, rows,
                                                                                              width, 6)
    with pytest.raises(TypeError, match="doubles"):
        KERNEL.csv_rows(heads, "9", tails, np.array(values, dtype=np.float32), 6, 5)
    with pytest.raises(ValueError, match="disagree"):
        KERNEL.csv_rows(heads, "9", None, np.array(values[:6]), 6, 5)


@needs_kernel
@pytest.mark.parametrize("ndigits", [1, 3, 5, 6, 9, 12])
def test_csv_rows_write_float32_values_as_percent_g_does(ndigits):
    """float32 values (the monitor's) are written in integer arithmetic: the bytes Python's %g writes, across
    every exponent, halfway cases and powers of ten included."""
    rng = np.random.default_rng(ndigits)
    bits = rng.integers(0, 2 ** 32, size=20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = [s * m * 10.0 ** i for i in range(-25, 25) for m in (1.0, 2.5, 5.0, 9.9999995) for s in (1, -1)]
    v = np.concatenate([bits[np.isfinite(bits)], np.float32(rng.standard_normal(20000)) * np.float32(10.0) **
                        rng.integers(-22, 22, 20000).astype(np.float32), np.float32(edges)]).astype(np.float64)
    v = v[np.isfinite(v)]
    want = "".join(",%.*g\r\n" % (ndigits, x) for x in v.tolist())
    assert KERNEL.csv_rows([""] * len(v), "", None, v, 1, ndigits) == want


@needs_kernel
def test_tensor_rows_take_plain_dense_float_tensors_only_and_all_or_none():
    engine = StatsEngine(OPS, 1e-8)
    rows = engine.tensor_rows
    plain = [torch.randn(3, 4), torch.nn.Parameter(torch.randn(5)), torch.randn(6, dtype=torch.float64),
             torch.randn(7).to(torch.bfloat16)]
    odd = [torch.randn(4, 3).t(), torch.randn(4).to(torch.float16), torch.randn(4).to(torch.int32),
           torch._neg_view(torch.randn(4)), torch.randn(4).as_subclass(type("Sub", (torch.Tensor,), {})),
           torch.randn(2, 2).to_sparse()]
    raw = bytearray()
    for t in odd:
        assert rows.row(raw, t, 1e-8, 1) is None and not raw
    assert rows.rows(raw, plain + odd[:1], 1e-8, 1) is None and not raw
    assert rows.rows(raw, plain, 1e-8, 1) == 0
    one = bytearray()
    for t in plain:
        code = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}[t.dtype]
        KERNEL.append_row(one, t.data_ptr(), t.numel(), code, 1e-8, 1)
    assert raw == one
    # the engine takes the Python route for the rest, in order
    mixed = bytearray()
    assert engine.append_rows(mixed, [plain[0], odd[0], odd[1], plain[1]]) == []
    assert len(mixed) == 4 * RAW_WIDTH * 8


_RUN = r"""
import json, os, sys, torch
from torch import nn
from msprobe_core.monitor.trainer_mon import TrainerMon
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8).to(torch.float64).to(torch.float32), nn.Tanh())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
out = sys.argv[1]
cfg = {"xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
       "ops": ["min", "max", "norm", "mean", "zeros", "nans"], "format": ["csv", "api"], "eps": 1e-3,
       "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]}}
mon = TrainerMon(cfg, output_dir=out)
mon.set_monitor(model, 2, opt)
g = torch.Generator().manual_seed(1)
for step in range(6):
    for _ in range(2):
        x = torch.randn(4, 8, generator=g)
        if step == 4:
            x[0, 0] = float("nan")
        nn.functional.mse_loss(model(x), torch.randn(4, 8, generator=g)).backward()
    opt.step()
    opt.zero_grad()
print(json.dumps([[(a.step, a.kind, a.name, a.metric, a.rule) for a in mon.anomalies], mon.get_metrics()]))
mon.close()
"""


def _csv_numbers(files: dict[str, bytes]) -> dict[str, list[list]]:
    return {name: [line.split(",") for line in data.decode().splitlines()] for name, data in files.items()}


def test_a_run_writes_its_rows_with_and_without_the_kernel(tmp_path):
    """The columns' route (kernel on) writes each step's rows as csv.writer would write its ``api`` numbers;
    without the kernel (torch's reductions: float32 sums in another order) the same files, names and alerts,
    the numbers within float32 rounding."""
    made = {}
    for fast in ("1", "0"):
        out = tmp_path / fast
        env = dict(os.environ, MSPROBE_FAST_STATS=fast, PYTHONPATH=os.pathsep.join(sys.path))
        done = subprocess.run([sys.executable, "-c", _RUN, str(out)], env=env, capture_output=True, text=True,
                              check=True)
        files = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(Path(out).rglob("*.csv"))}
        made[fast] = (_csv_numbers(files), *json.loads(done.stdout.strip().splitlines()[-1]))
    (fast, alerts, latest), (slow, slow_alerts, _) = made["1"], made["0"]
    assert alerts and alerts == slow_alerts and fast.keys() == slow.keys() and len(fast) >= 6 * 5
    for name, lines in fast.items():
        assert [line[:3] for line in lines] == [line[:3] for line in slow[name]]
        for a, b in zip(lines[1:], slow[name][1:]):
            assert np.allclose([float(v) for v in a[3:]], [float(v) for v in b[3:]], rtol=1e-5, equal_nan=True)
    step = latest["step"]
    for kind, rows in latest["metrics"].items():
        lines = [line for line in fast[f"rank0/{kind}_{step}-{step}.csv"][1:]]
        want = [[name.split(":")[0], str(step), *([name.split(":")[1]] if ":" in name else []),
                 *[f"{v:.6g}" for v in values.values()]] for name, values in rows.items()]
        assert lines == want
