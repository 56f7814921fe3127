"""The per-record path of the monitor: ``StepCollector`` rows, the kernel's host rows against the device
path, the CSV lines against ``csv.writer``, the NaN/Inf shortcut of the detector and ``gc_paused``."""

from __future__ import annotations

import csv
import gc
import io
import math

import numpy as np
import pytest
import torch

from msprobe_core.monitor.collector import StepCollector
from msprobe_core.monitor.config import AlertConfig
from msprobe_core.monitor.detector import AnomalyDetector
from msprobe_core.monitor.gc_pause import gc_paused
from msprobe_core.monitor.records import MetricRow
from msprobe_core.monitor.stats import StatsEngine
from msprobe_core.monitor.writers.base import WriterContext
from msprobe_core.monitor.writers import csv_writer
from msprobe_core.monitor.writers.csv_writer import CsvWriter, _field

OPS = ("min", "max", "norm", "mean", "zeros", "nans")


def _engine(ops=OPS) -> StatsEngine:
    return StatsEngine(ops, 1e-8)


def test_rows_carry_every_field_in_call_order_with_aliases():
    c = StepCollector(_engine())
    a, b = torch.randn(3, 4), torch.randn(5)
    w = c.slot(a)
    c.add_entry("actv", "m.output", "m", 0, a.numel(), w)
    c.add_entry("actv", "n.input", "n", 0, a.numel(), w)  # the same tensor seen again: an alias
    c.record("grad", [("p.weight", "p", b), ("p.empty", "p", torch.empty(0))])
    c.add_entry("actv", "x.input", "x", 1, 4, c.slot(torch.ones(4)), external=True, alias=False)
    rows = c.finalize()
    assert [r.name for r in rows] == ["m.output", "n.input", "p.weight", "x.input"]
    assert all(type(r) is MetricRow for r in rows)
    assert [r.call_id for r in rows] == [0, 1, 2, 3]
    assert [r.alias for r in rows] == [False, True, False, False]
    assert [r.external for r in rows] == [False, False, False, True]
    assert (rows[0].kind, rows[0].module, rows[0].micro_step, rows[0].numel) == ("actv", "m", 0, 12)
    assert (rows[2].kind, rows[2].micro_step, rows[2].numel) == ("grad", None, 5)
    assert rows[0].values == rows[1].values and len(rows[0].values) == len(OPS)
    assert len(c) == 0 and c.finalize() == []


@pytest.mark.parametrize("ops", [OPS, ("norm",), ("nans", "min", "zeros")])
def test_kernel_rows_equal_the_device_path_after_float32_rounding(ops):
    engine = _engine(ops)
    if not engine.host_rows:
        pytest.skip("the one-pass kernel is not built")
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(33, 7, generator=g), torch.randn(64, generator=g, dtype=torch.float64),
               torch.randn(8, 8, generator=g).to(torch.bfloat16), torch.randn(6, 5, generator=g).t(),
               torch.tensor([0.0, math.nan, 1.0, -2.0])]
    c = StepCollector(engine)
    c.record("param", [(f"t{i}", "m", t) for i, t in enumerate(tensors)])
    got = [list(r.values) for r in c.finalize()]
    want = engine.compute(tensors).tolist()
    assert repr(got) == repr(want)  # nan-aware and bit for bit


def _kernel_buffers():
    """The kernel, and float32/bfloat16/float64 buffers of sizes around its block and thread limits, each with
    a NaN, an Inf, a zero or a one; their dtype codes."""
    from msprobe_core.stats.kernel import KERNEL
    if KERNEL is None:
        pytest.skip("the one-pass kernel is not built")
    g = torch.Generator().manual_seed(0)
    tensors = []
    for i, n in enumerate([1, 15, 16, 17, 64, 4095, 4096, 4097, 9000, (1 << 17) + 3]):
        t = torch.randn(n, generator=g) * 10.0 ** (i - 5)
        t[n // 2] = [math.nan, math.inf, 0.0, -math.inf, 1.0][i % 5]
        tensors += [t, t.to(torch.bfloat16), t.to(torch.float64)]
    codes = [{torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}[t.dtype] for t in tensors]
    return KERNEL, tensors, codes


@pytest.mark.parametrize("eps", [1e-8, -1.0])
def test_stats_many_gives_what_stats_gives_for_each_buffer(eps):
    from array import array

    kernel, tensors, codes = _kernel_buffers()
    out = array("d", bytes(48 * len(tensors)))
    kernel.stats_many([t.data_ptr() for t in tensors], [t.numel() for t in tensors], codes, eps, 2, out)
    for i, (t, code) in enumerate(zip(tensors, codes)):
        want = kernel.stats(t.data_ptr(), t.numel(), code, eps, 2)
        assert repr(tuple(out[6 * i:6 * i + 6])) == repr(want)  # nan-aware and bit for bit
    with pytest.raises(ValueError, match="same length"):
        kernel.stats_many([tensors[0].data_ptr()], [], [], eps, 1, out)
    with pytest.raises(ValueError, match="needed"):
        kernel.stats_many([tensors[0].data_ptr()], [1], [0], eps, 1, array("d"))


@pytest.mark.parametrize("eps", [1e-8, -1.0])
def test_appended_rows_are_what_stats_gives_and_the_element_count(eps):
    from array import array

    kernel, tensors, codes = _kernel_buffers()
    raw = bytearray()
    assert kernel.append_row(raw, tensors[0].data_ptr(), tensors[0].numel(), codes[0], eps, 2) == 0
    assert kernel.append_rows(raw, [t.data_ptr() for t in tensors], [t.numel() for t in tensors], codes, eps, 2) == 1
    assert kernel.append_rows(raw, [], [], [], eps, 2) == len(tensors) + 1
    rows = array("d")
    rows.frombytes(raw)
    for i, (t, code) in enumerate(zip([tensors[0], *tensors], [codes[0], *codes])):
        want = kernel.stats(t.data_ptr(), t.numel(), code, eps, 2) + (float(t.numel()),)
        assert repr(tuple(rows[7 * i:7 * i + 7])) == repr(want)  # nan-aware and bit for bit
    with pytest.raises(TypeError, match="bytearray"):
        kernel.append_row(array("d"), tensors[0].data_ptr(), 1, 0, eps, 1)
    with pytest.raises(ValueError, match="same length"):
        kernel.append_rows(raw, [tensors[0].data_ptr()], [], [], eps, 1)


def test_a_batch_of_small_tensors_spread_over_threads_gives_each_row_bit_for_bit():
    """Thousands of small tensors (an optimizer's parameters and moments) are reduced over the threads one tensor
    per thread at a time, big ones split themselves: the rows are the same whatever the thread count."""
    from msprobe_core.stats.kernel import KERNEL as kernel
    if kernel is None:
        pytest.skip("the one-pass kernel is not built")
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(64, 64, generator=gen) for _ in range(200)]
    tensors[7][1, 2] = float("nan")
    tensors[9].zero_()
    tensors.insert(50, torch.randn(1 << 18, generator=gen))  # one big enough to split over the threads itself
    tensors.append(torch.randn(5, generator=gen).to(torch.bfloat16))
    codes = [{torch.float32: 0, torch.bfloat16: 2}[t.dtype] for t in tensors]
    rows = {}
    for threads in (1, 2, 3):
        raw = bytearray()
        kernel.append_rows(raw, [t.data_ptr() for t in tensors], [t.numel() for t in tensors], codes, 1e-8, threads)
        rows[threads] = bytes(raw)
    assert rows[1] == rows[2] == rows[3]
    singles = bytearray()
    for t, code in zip(tensors, codes):
        kernel.append_row(singles, t.data_ptr(), t.numel(), code, 1e-8, 1)
    assert bytes(singles) == rows[1]


def test_csv_rows_writes_what_percent_g_writes():
    kernel = _kernel_buffers()[0]
    values = [0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, -math.nan, 1e-300, 123456789.0, 3.4e38, 1e-45, 0.1]
    heads = ["a,", '"b,c",']
    for tails in (None, [",0", ",-1"]):
        want = "".join(h + "9" + (tails[i] if tails else "") + "".join(",%.5g" % v for v in values[6 * i:6 * i + 6])
                       + "\r\n" for i, h in enumerate(heads))
        assert kernel.csv_rows(heads, "9", tails, values, 6, 5) == want
    with pytest.raises(ValueError, match="disagree"):
        kernel.csv_rows(heads, "9", None, values, 5, 5)


def test_csv_rows_writes_every_float32_as_percent_g_writes_it():
    # the kernel's integer digits (tiny optimizer moments of 1e-30 and denormals included) against Python's own
    kernel = _kernel_buffers()[0]
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = bits[np.isfinite(bits)].astype(np.float64)
    ties = [(i + 0.5) * 2.0**j for i in range(0, 200, 7) for j in range(-12, 12)]
    edges = [1e-45, 1.17549435e-38, 3.4028235e38, 2.0**-149, 2.0**127, 9.9999995, 999999.5, 2.0**24 - 1, 2.0**24]
    values = np.concatenate([values[values != 0], np.float32(ties + edges).astype(np.float64)])
    for p in range(1, 10):
        got = kernel.csv_rows(["a,"] * len(values), "1", None, values, 1, p).split("\r\n")[:-1]
        assert got == ["a,1," + f"%.{p}g" % v for v in values]


def test_has_nonfinite_and_recorded_look_at_the_stages_asked():
    c = StepCollector(_engine())
    c.record("actv", [("a.output", "a", torch.tensor([1.0, math.inf]))])
    assert not c.recorded(("backward", "gradient")) and c.recorded(("forward",))
    assert not c.has_nonfinite(("backward", "gradient")) and c.has_nonfinite(("forward",))
    c.record("grad", [("w", "m", torch.tensor([math.nan, 1.0]))])
    assert c.has_nonfinite(("gradient",))


@pytest.mark.parametrize("name", ["a.b", "a,b", 'a"b', "a\nb", "a\rb", " x", ""])
def test_csv_fields_are_quoted_as_csv_writer_quotes_them(name):
    out = io.StringIO()
    csv.writer(out).writerow([name, 3, "1.5"])
    assert _field(name) + ",3,1.5\r\n" == out.getvalue()


@pytest.mark.parametrize("kernel", [True, False])
def test_csv_writer_writes_the_bytes_csv_writer_would(tmp_path, monkeypatch, kernel):
    if not kernel:
        monkeypatch.setattr(csv_writer, "_csv_rows", None)
    w = CsvWriter(WriterContext(rank_dir=tmp_path, ops=("min", "norm"), ndigits=4, with_micro=True))
    rows = [MetricRow("actv", "l,1.output", "l,1", 0, 0, 4, (1.0, math.nan)),
            MetricRow("grad", "w", "m", None, 1, 4, (-math.inf, 1.23456789e-7)),
            MetricRow("actv", "l2.output", "l2", 1, 2, 4, (2.5, 3.0))]
    w.write(7, rows)
    w.close()
    want = io.StringIO()
    cw = csv.writer(want)
    cw.writerow(["name", "step", "micro_step", "min", "norm"])
    for r in (rows[0], rows[2]):
        cw.writerow([r.name, 7, r.micro_step, *[f"{v:.4g}" for v in r.values]])
    assert (tmp_path / "actv_7-7.csv").read_bytes().decode() == want.getvalue()
    # a kind's first row decides whether its file has a micro_step column (grad: none)
    assert (tmp_path / "grad_7-7.csv").read_bytes().decode() == "name,step,min,norm\r\nw,7,-inf,1.235e-07\r\n"


@pytest.mark.parametrize("kernel", [True, False])
def test_csv_templates_follow_steps_names_and_odd_characters(tmp_path, monkeypatch, kernel):
    if not kernel:  # the Python templates (no kernel) write the same bytes
        monkeypatch.setattr(csv_writer, "_csv_rows", None)
    w = CsvWriter(WriterContext(rank_dir=tmp_path, ops=("min",), ndigits=3, step_count_per_record=3))
    steps = {4: ["a%s.output", "b%%"], 5: ["a%s.output", "b%%"], 6: ["c\0d", "e"]}
    for step, names in steps.items():
        w.write(step, [MetricRow("grad", n, "m", None, i, 1, (step + i / 3,)) for i, n in enumerate(names)])
    w.close()
    want = io.StringIO()
    cw = csv.writer(want)
    cw.writerow(["name", "step", "min"])
    for step, names in steps.items():
        for i, n in enumerate(names):
            cw.writerow([n, step, f"{step + i / 3:.3g}"])
    assert (tmp_path / "grad_4-6.csv").read_bytes().decode() == want.getvalue()


def _rows(values, external=False):
    return [MetricRow("actv", f"m{i}.output", f"m{i}", 0, i, 4, v, external=external) for i, v in enumerate(values)]


@pytest.mark.parametrize("values, external", [
    ([(0.0, 1.0, 2.0, 0.5, 0.0, 0.0)] * 3, False),
    ([(0.0, 1.0, 2.0, 0.5, 0.0, 0.0), (-math.inf, 1.0, math.inf, -math.inf, 0.0, 0.0)], True),
    ([(0.0, 1.0, 2.0, 0.5, 0.0, 0.0), (math.nan, math.nan, math.nan, math.nan, 0.0, 2.0)], False),
    ([(3e38, 3e38, 3e38, 3e38, 0.0, 0.0)] * 4, False),  # the sum overflows: judged row by row
])
def test_the_all_finite_shortcut_finds_what_row_by_row_finds(values, external):
    found = []
    for shortcut in (True, False):
        det = AnomalyDetector(AlertConfig(enabled=True), OPS)
        if not shortcut:
            det._all_finite = lambda rows: False
        found.append([(a.name, a.metric) for a in det.check(0, 1, _rows(values, external))])
    assert found[0] == found[1]


def test_gc_paused_restores_the_collector_also_on_error():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # left as it was
    finally:
        gc.enable()
