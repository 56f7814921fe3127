"""Unit tests of the compare building blocks: names, leaves, alignment, metrics, file reading, xlsx."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from msprobe_core.compare.align import _myers, align_records
from msprobe_core.dumpdir.tensor_reader import ArrayTensor, load_array
from msprobe_core.dumpdir.record_leaves import flatten_record, normalize_name
from msprobe_core.compare.tensors import compare_arrays, run_jobs
from msprobe_core.compare.thresholds import ERROR, PASS, WARNING, Thresholds
from msprobe_core.compare.xlsx import column_letter, write_xlsx


@pytest.mark.parametrize("name, expected", [
    ("Functional.relu.3.forward", "Functional.relu.*.forward"),
    ("Tensor.__add__.12.backward", "Tensor.__add__.*.backward"),
    ("Aten.add.Tensor.0.forward", "Aten.add.Tensor.*.forward"),
    ("Module.conv2.Conv2d.forward.0", "Module.conv2.Conv2d.forward.*"),
    ("Module.0.layer.Linear.backward.2", "Module.0.layer.Linear.backward.*"),
    ("Module.conv2.Conv2d.parameters_grad.0", "Module.conv2.Conv2d.parameters_grad.*"),
    ("Module.conv2.Conv2d.parameters_grad", "Module.conv2.Conv2d.parameters_grad"),
    ("Module.layers.1.Block.forward.0", "Module.layers.1.Block.forward.*"),
    ("odd_name", "odd_name"),
])
def test_normalize_name(name, expected):
    assert normalize_name(name) == expected


def test_flatten_forward_record():
    t = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2]}
    rec = {"input_args": [t, [t, None, t], {"type": "int", "value": 3}], "input_kwargs": {"alpha": t, "dim": None},
           "output": [t], "parameters": {"weight": t}}
    paths = [leaf.path for leaf in flatten_record(rec)]
    assert paths == ["input.0", "input.1.0", "input.1.2", "input.2", "input.alpha", "output.0", "parameters.weight"]
    leaves = flatten_record(rec)
    assert [leaf.is_tensor for leaf in leaves] == [True, True, True, False, True, True, True]
    assert leaves[-1].role == "parameters"


def test_flatten_backward_and_param_grad():
    t = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2]}
    assert [l.path for l in flatten_record({"input": [t, None], "output": [t, t]})] == ["input.0", "output.0", "output.1"]
    assert [l.path for l in flatten_record({"weight": [t], "bias": [t]})] == ["weight", "bias"]


def test_flatten_debug_records():
    t = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2]}
    assert [(l.path, l.is_tensor) for l in flatten_record(t)] == [("", True)]
    assert [l.path for l in flatten_record({"a": t, "b": [t, {"type": "int", "value": 1}]})] == ["a", "b.0", "b.1"]
    assert [l.path for l in flatten_record([t, t])] == ["0", "1"]


def test_align_same_names_pairs_by_name():
    names = ["Functional.a.0.forward", "Functional.b.0.forward"]
    assert align_records(names, list(reversed(names))) == [(n, n) for n in names]


def test_align_extra_call_shifts_counts():
    golden = ["Functional.linear.0.forward", "Functional.relu.0.forward", "Functional.linear.1.forward",
              "Functional.relu.1.forward", "Functional.relu.1.backward", "Functional.linear.1.backward"]
    target = golden[:2] + ["Functional.relu.1.forward"] + [n.replace("relu.1", "relu.2") for n in golden[2:]]
    merged = align_records(target, golden)
    assert ("Functional.relu.1.forward", None) in merged
    assert ("Functional.relu.2.forward", "Functional.relu.1.forward") in merged
    assert ("Functional.relu.2.backward", "Functional.relu.1.backward") in merged
    assert [t for t, g in merged if g is None] == ["Functional.relu.1.forward"]
    assert all(t is not None for t, g in merged)


def test_align_uses_parents_only_when_both_have_them():
    golden = ["Functional.relu.0.forward", "Functional.relu.1.forward"]
    target = ["Functional.relu.0.forward", "Functional.relu.1.forward", "Functional.relu.2.forward"]
    tc = {"Functional.relu.0.forward": "Module.a.A.forward.0", "Functional.relu.1.forward": "Module.b.B.forward.0",
          "Functional.relu.2.forward": "Module.c.C.forward.0"}
    gc = {"Functional.relu.0.forward": "Module.a.A.forward.0", "Functional.relu.1.forward": "Module.c.C.forward.0"}
    merged = align_records(target, golden, tc, gc)
    assert ("Functional.relu.1.forward", None) in merged  # the call inside module b is the extra one
    assert ("Functional.relu.2.forward", "Functional.relu.1.forward") in merged
    assert len(align_records(target, golden, tc, {})) == 3  # one side without hierarchy: names only


def test_myers_is_a_shortest_edit_script():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randint(0, 3) for _ in range(rng.randint(0, 10))]
        b = [rng.randint(0, 3) for _ in range(rng.randint(0, 10))]
        ops = _myers(a, b, 100)
        i = j = 0
        for op in ops:
            if op == "=":
                assert a[i] == b[j]
                i, j = i + 1, j + 1
            elif op == "-":
                i += 1
            else:
                j += 1
        assert (i, j) == (len(a), len(b))
        lcs = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
        for x in range(len(a)):
            for y in range(len(b)):
                lcs[x + 1][y + 1] = lcs[x][y] + 1 if a[x] == b[y] else max(lcs[x][y + 1], lcs[x + 1][y])
        assert ops.count("=") == lcs[len(a)][len(b)]


def test_align_large_dumps():
    """30,000 records each side (a quadratic alignment would not finish within the test timeout; its speed is
    measured in benchmarks/compare_speed.py, not here)."""
    golden = [f"Functional.op{i % 13}.{i // 13}.forward" for i in range(30000)]
    target = golden[:50] + ["Tensor.extra.0.forward"] + golden[50:-50] + ["Tensor.extra.1.forward"] + golden[-50:]
    merged = align_records(target, golden)
    assert [t for t, g in merged if g is None] == ["Tensor.extra.0.forward", "Tensor.extra.1.forward"]


def _arr(x: np.ndarray) -> ArrayTensor:
    return ArrayTensor(np.ascontiguousarray(x).reshape(-1), str(x.dtype), x.shape)


def test_metrics_match_definitions():
    rng = np.random.default_rng(0)
    g = rng.standard_normal(1000).astype(np.float32)
    t = (g + rng.standard_normal(1000).astype(np.float32) * 0.01).astype(np.float32)
    r = compare_arrays(_arr(t), _arr(g))
    t64, g64 = t.astype(np.float64), g.astype(np.float64)
    assert r.cosine == pytest.approx(t64 @ g64 / np.linalg.norm(t64) / np.linalg.norm(g64), abs=1e-6)
    assert r.rmse == pytest.approx(np.sqrt(np.mean((t64 - g64) ** 2)), rel=1e-5)
    assert r.max_abs == pytest.approx(np.abs(t64 - g64).max(), rel=1e-6)
    rel = np.abs(t64 - g64) / np.abs(g64)
    assert r.max_rel == pytest.approx(rel.max(), rel=1e-4)
    assert r.ratio_1e3 == pytest.approx(np.mean(rel <= 1e-3), abs=2e-3)
    assert r.ratio_1e4 == pytest.approx(np.mean(rel <= 1e-4), abs=2e-3)


def test_metrics_special_cases():
    z = np.zeros(4, np.float32)
    assert compare_arrays(_arr(z), _arr(z.copy())).cosine == 1.0
    one_zero = compare_arrays(_arr(z), _arr(np.ones(4, np.float32)))
    assert one_zero.cosine is None and one_zero.max_abs == 1.0
    x = np.array([1, np.nan, np.inf, 2], np.float32)
    same = compare_arrays(_arr(x), _arr(np.array([1, np.nan, np.inf, 2.5], np.float32)))
    assert same.problem == "" and same.max_abs == pytest.approx(0.5)
    moved = compare_arrays(_arr(x), _arr(np.array([1, 3, np.inf, 2], np.float32)))
    assert "NaN/Inf" in moved.problem
    assert "shape" in compare_arrays(_arr(np.ones((2, 3))), _arr(np.ones((3, 2)))).problem
    assert compare_arrays(_arr(-x[:1]), _arr(x[:1])).cosine == -1.0
    ints = compare_arrays(_arr(np.arange(5)), _arr(np.arange(5) + 1))
    assert ints.max_abs == 1.0
    half = compare_arrays(_arr(np.ones(3, np.float16)), _arr(np.ones(3, np.float32)))
    assert half.max_abs == 0.0 and half.cosine == pytest.approx(1.0)


def test_tensor_verdicts():
    th = Thresholds()
    assert th.tensor_verdict(0.5, 0.1)[0] == ERROR
    assert th.tensor_verdict(0.5, 0.0001)[0] == WARNING
    assert th.tensor_verdict(0.999, 0.1)[0] == WARNING
    assert th.tensor_verdict(0.999, 0.0001)[0] == PASS
    assert th.tensor_verdict(None, 0.1)[0] == ERROR
    assert th.tensor_verdict(1.0, 0.5, 2.0)[0] == ERROR  # scaled by a wrong factor: cosine cannot see it
    assert th.tensor_verdict(1.0, 0.0005, 2.0)[0] == WARNING
    assert th.tensor_verdict(0.999, 0.1, 0.05)[0] == WARNING
    assert th.stat_verdict({"Max": (0.5, 0.5)})[0] == ERROR
    assert th.stat_verdict({"Mean": (0.5, 0.5)})[0] == WARNING
    assert th.stat_verdict({"Max": (0.0005, 0.5)})[0] == PASS
    assert th.stat_verdict({"Norm": (0.05, 0.05)})[0] == WARNING


def test_load_array_reads_torch_files_without_torch_for_plain_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    cases = {"f32": torch.randn(3, 4), "bf16": torch.randn(5, 6).bfloat16(), "f16": torch.randn(7).half(),
             "i64": torch.arange(10), "bool": torch.tensor([True, False]), "scalar": torch.tensor(3.5),
             "empty": torch.empty(0, 3), "transposed": torch.randn(4, 5).t(), "slice": torch.randn(10, 10)[2:4],
             "c64": torch.randn(3, dtype=torch.complex64), "param": torch.nn.Parameter(torch.randn(3))}
    for key, tensor in cases.items():
        path = tmp_path / f"{key}.pt"
        torch.save(tensor, path)
        loaded = load_array(str(path))
        assert loaded.shape == tuple(tensor.shape), key
        ref = tensor.detach().contiguous()
        ref = torch.view_as_real(ref) if ref.is_complex() else ref
        np.testing.assert_array_equal(loaded.values().astype(np.float64), ref.reshape(-1).double().numpy())
    np.save(tmp_path / "x.npy", np.arange(6, dtype=np.float32).reshape(2, 3))
    assert load_array(str(tmp_path / "x.npy")).shape == (2, 3)


def test_parallel_jobs_match_in_process(tmp_path):
    torch = pytest.importorskip("torch")
    pairs = []
    for i in range(12):
        a = torch.randn(64, 64)
        torch.save(a, tmp_path / f"a{i}.pt")
        torch.save(a + 0.001 * i * torch.randn(64, 64), tmp_path / f"b{i}.pt")
        pairs.append((str(tmp_path / f"a{i}.pt"), str(tmp_path / f"b{i}.pt")))
    serial = run_jobs(pairs, workers=1)
    parallel = run_jobs(pairs, workers=2, parallel_min_bytes=0)
    assert serial == parallel
    assert serial[0].max_abs == 0.0 and serial[5].max_abs > 0


def test_column_letters():
    assert [column_letter(i) for i in (1, 26, 27, 52, 703)] == ["A", "Z", "AA", "AZ", "AAA"]


def test_xlsx_reads_back_with_openpyxl(tmp_path):
    openpyxl = pytest.importorskip("openpyxl")
    path = tmp_path / "x.xlsx"
    write_xlsx(path, ["Name", "Value", "Text"], [["a<&>", 1.5, "line1\nline2"], ["b", math.inf, None], ["c", 3, " x"]],
               row_fills=[0, None, 1], fills=["FFC7CE", "FFEB9C"])
    ws = openpyxl.load_workbook(path).active
    assert [c.value for c in ws[1]] == ["Name", "Value", "Text"]
    assert ws["A1"].font.b
    assert [c.value for c in ws[2]] == ["a<&>", 1.5, "line1\nline2"]
    assert ws["B3"].value == "inf" and ws["C3"].value is None
    assert ws["A2"].fill.fgColor.rgb == "FFFFC7CE" and ws["A4"].fill.fgColor.rgb == "FFFFEB9C"
    assert ws["A3"].fill.fill_type is None
    assert ws.freeze_panes == "C2" and ws.auto_filter.ref == "A1:C4"


def test_progress_bar_does_not_disturb_results(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    torch.save(torch.ones(3), tmp_path / "a.pt")
    torch.save(torch.zeros(3), tmp_path / "b.pt")
    results = run_jobs([(str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))] * 3, workers=1, progress=True)
    assert [r.cosine for r in results] == [None] * 3 and results[0].max_abs == 1.0
