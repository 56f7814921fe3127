"""End-to-end compare tests on synthetic dumps (tests/compare_fixtures.py)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from compare_fixtures import DumpBuilder, mlp_run
from msprobe_core.cli import main
from msprobe_core.compare import compare_dumps, summary_text, write_outputs
from msprobe_core.compare.thresholds import ERROR, PASS, UNMATCHED, WARNING

REPO = Path(__file__).resolve().parents[3]


def _rows(csv_path: Path) -> list[dict]:
    with open(csv_path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("task", ["tensor", "statistics"])
def test_identical_runs_compare_clean(tmp_path, task, capsys):
    mlp_run(tmp_path / "g/step0/rank0", task=task)
    mlp_run(tmp_path / "t/step0/rank0", task=task)
    rc = main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "No divergence" in out.splitlines()[-1]
    rows = _rows(tmp_path / "out/compare_result.csv")
    assert rows and {r["Result"] for r in rows} == {PASS}
    assert (tmp_path / "out/compare_result.xlsx").is_file()
    summary = json.loads((tmp_path / "out/compare_summary.json").read_text())
    assert summary["pairs"][0]["first_divergence"] is None
    if task == "tensor":
        assert all(float(r["Cosine"]) == 1.0 for r in rows if r["Cosine"])


@pytest.mark.parametrize("task", ["tensor", "statistics"])
@pytest.mark.parametrize("layer", [0, 2])
def test_perturbed_weight_diverges_at_its_layer(tmp_path, task, layer, capsys):
    mlp_run(tmp_path / "g/step0/rank0", task=task)
    mlp_run(tmp_path / "t/step0/rank0", task=task, perturb=layer)
    rc = main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 1
    expected = f"Functional.linear.{layer}.forward"
    assert out.splitlines()[-1] == f"First divergence: {expected}"
    assert "stack (innermost last" in out
    summary = json.loads((tmp_path / "out/compare_summary.json").read_text())
    div = summary["pairs"][0]["first_divergence"]
    assert div["target_record"] == expected
    assert any(r["path"] == "input.1" for r in div["rows"])  # the weight itself differs
    rows = _rows(tmp_path / "out/compare_result.csv")
    earlier = [r for r in rows if int(r["Index"]) < 2 * layer]
    assert all(r["Result"] == PASS for r in earlier)


def test_extra_call_on_one_side_still_aligns(tmp_path, capsys):
    mlp_run(tmp_path / "g/step0/rank0")
    mlp_run(tmp_path / "t/step0/rank0", extra_call_after=1)
    rc = main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "only in target (1): Tensor.mul.0.forward" in out
    rows = _rows(tmp_path / "out/compare_result.csv")
    unmatched = [r for r in rows if r["Result"] == UNMATCHED]
    assert unmatched and all(r["Target Name"].startswith("Tensor.mul.0.forward.") for r in unmatched)
    assert all(r["Golden Name"] == "" for r in unmatched)
    assert {r["Result"] for r in rows} == {PASS, UNMATCHED}


def test_extra_call_on_golden_side_and_divergence_after_it(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0", extra_call_after=0)
    mlp_run(tmp_path / "t/step0/rank0", perturb=2)
    result = compare_dumps(tmp_path / "t", tmp_path / "g")
    pair = result.pairs[0]
    assert pair.only_golden == ["Tensor.mul.0.forward"] and pair.only_target == []
    assert pair.divergence.target_record == "Functional.linear.2.forward"


def test_extra_call_shifting_counts_of_the_same_api(tmp_path):
    """An extra relu renumbers every later relu: they must still pair with their counterparts."""
    g, t = DumpBuilder(), DumpBuilder()
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(4).astype(np.float32) for _ in range(4)]
    for i, x in enumerate(xs):
        g.forward(f"Functional.relu.{i}.forward", [x], [np.maximum(x, 0)])
    t.forward("Functional.relu.0.forward", [xs[0]], [np.maximum(xs[0], 0)])
    t.forward("Functional.relu.1.forward", [xs[0]], [np.maximum(xs[0], 0)])  # the extra call
    for i, x in enumerate(xs[1:], start=2):
        t.forward(f"Functional.relu.{i}.forward", [x], [np.maximum(x, 0)])
    g.write(tmp_path / "g")
    t.write(tmp_path / "t")
    pair = compare_dumps(tmp_path / "t", tmp_path / "g").pairs[0]
    assert pair.divergence is None
    assert len(pair.only_target) == 1 and not pair.only_golden
    assert ("Functional.relu.4.forward", "Functional.relu.3.forward") in pair.merged


def test_mix_level_drills_down_to_the_api_inside_the_module(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0", level="mix")
    mlp_run(tmp_path / "t/step0/rank0", level="mix", perturb=1)
    result = compare_dumps(tmp_path / "t", tmp_path / "g")
    div = result.pairs[0].divergence
    # the module record starts first and fails too; the failing call inside it is the divergence
    assert div.target_record == "Functional.linear.1.forward"
    assert div.parent == "Module.layers.1.Layer.forward.0"
    text = summary_text(result)
    assert "parent module: Module.layers.1.Layer.forward.0" in text
    assert text.splitlines()[-1] == ("First divergence: Functional.linear.1.forward "
                                     "(parent Module.layers.1.Layer.forward.0)")


def test_module_level_parameters_pinpoint_the_module(tmp_path):
    """L0: a parent module and its child both fail; the child holding the changed weight is named."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    w1 = rng.standard_normal((4, 4)).astype(np.float32)
    w2 = rng.standard_normal((4, 4)).astype(np.float32)
    for side, w in (("g", w2), ("t", w2 * 3)):
        b = DumpBuilder(level="L0")
        parent = "Module.block.Sequential.forward.0"
        b.forward(parent, [x], [x @ w1.T @ w.T], params={})
        b.forward("Module.block.0.Linear.forward.0", [x], [x @ w1.T], params={"weight": w1}, parent=parent)
        b.forward("Module.block.1.Linear.forward.0", [x @ w1.T], [x @ w1.T @ w.T], params={"weight": w},
                  parent=parent)
        b.write(tmp_path / side)
    div = compare_dumps(tmp_path / "t", tmp_path / "g").pairs[0].divergence
    assert div.target_record == "Module.block.1.Linear.forward.0"
    assert {r.path for r in div.rows} >= {"parameters.weight", "output.0"}
    assert not div.inputs_differ


def test_statistics_thresholds_and_md5(tmp_path):
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    cases = {"same": x, "tiny": x * (1 + 1e-5), "warn": x * 1.05, "fail": x * 2}
    for side in ("g", "t"):
        b = DumpBuilder(task="statistics", summary_mode="md5")
        for i, (key, arr) in enumerate(cases.items()):
            b.forward(f"Functional.{key}.0.forward", [x], [arr if side == "t" else x])
        b.write(tmp_path / side)
    pair = compare_dumps(tmp_path / "t", tmp_path / "g").pairs[0]
    verdicts = {r.target_record: r.verdict for r in pair.rows if r.path == "output.0"}
    assert verdicts["Functional.same.0.forward"] == PASS
    assert verdicts["Functional.tiny.0.forward"] == ERROR  # md5 says the bits differ
    assert verdicts["Functional.fail.0.forward"] == ERROR
    assert pair.divergence.target_record == "Functional.tiny.0.forward"
    write_outputs(compare_dumps(tmp_path / "t", tmp_path / "g"), tmp_path / "out", xlsx=False)
    header = _rows(tmp_path / "out/compare_result.csv")[0].keys()
    assert {"Max diff", "Norm RelDiff", "Target MD5", "Golden MD5"} <= set(header)


def test_statistics_without_md5_warns_then_fails(tmp_path):
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    cases = {"tiny": x * (1 + 1e-5), "warn": x * 1.05, "fail": x * 2}
    for side in ("g", "t"):
        b = DumpBuilder(task="statistics")
        for key, arr in cases.items():
            b.forward(f"Functional.{key}.0.forward", [x], [arr if side == "t" else x])
        b.write(tmp_path / side)
    pair = compare_dumps(tmp_path / "t", tmp_path / "g").pairs[0]
    verdicts = {r.target_record: r.verdict for r in pair.rows if r.path == "output.0"}
    assert verdicts == {"Functional.tiny.0.forward": PASS, "Functional.warn.0.forward": WARNING,
                        "Functional.fail.0.forward": ERROR}


def test_shapes_dtypes_values_and_nans(tmp_path):
    nan = np.array([1.0, np.nan, 3.0], np.float32)
    for side in ("g", "t"):
        b = DumpBuilder()
        b.forward("Functional.a.0.forward", [np.ones((2, 3), np.float32)],
                  [np.ones((3, 2) if side == "t" else (2, 3), np.float32)])
        b.forward("Functional.b.0.forward", [np.ones(3, np.float16 if side == "t" else np.float32)], [nan])
        b.forward("Functional.c.0.forward", [nan, 2 if side == "t" else 3],
                  [np.array([1.0, 2.0, 3.0], np.float32) if side == "t" else nan])
        b.write(tmp_path / side)
    pair = compare_dumps(tmp_path / "t", tmp_path / "g").pairs[0]
    by_name = {r.name("target"): r for r in pair.rows}
    assert by_name["Functional.a.0.forward.output.0"].verdict == ERROR
    assert "shape" in by_name["Functional.a.0.forward.output.0"].messages[0]
    assert by_name["Functional.b.0.forward.input.0"].verdict == WARNING  # dtype only
    assert by_name["Functional.b.0.forward.output.0"].verdict == PASS  # NaN at the same place
    assert by_name["Functional.c.0.forward.input.1"].verdict == WARNING  # plain value 2 vs 3
    assert by_name["Functional.c.0.forward.output.0"].verdict == ERROR  # NaN on one side only
    assert pair.divergence.target_record == "Functional.a.0.forward"


def test_backward_divergence_gets_the_forward_stack(tmp_path):
    x = np.ones(4, np.float32)
    for side in ("g", "t"):
        b = DumpBuilder()
        b.forward("Functional.relu.0.forward", [x], [x], stack=["File /m.py, line 7, in forward, \n  relu(x)"])
        b.backward("Functional.relu.0.backward", [x], [x * (-1 if side == "t" else 1)])
        b.write(tmp_path / side)
    result = compare_dumps(tmp_path / "t", tmp_path / "g")
    div = result.pairs[0].divergence
    assert div.target_record == "Functional.relu.0.backward"
    assert div.stack == ["File /m.py, line 7, in forward, \n  relu(x)"]
    assert "stack of Functional.relu.0.forward" in summary_text(result)


def test_whole_dump_paths_pair_every_step_and_rank(tmp_path, capsys):
    for step in (0, 1):
        for rank in (0, 1):
            mlp_run(tmp_path / f"g/step{step}/rank{rank}", seed=step * 10 + rank)
            perturb = 3 if (step, rank) == (1, 1) else None
            mlp_run(tmp_path / f"t/step{step}/rank{rank}", seed=step * 10 + rank, perturb=perturb)
    rc = main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "out"), "-q"])
    out = capsys.readouterr().out
    assert rc == 1
    assert out.splitlines()[-1] == "First divergence: step1/rank1 Functional.linear.3.forward"
    names = sorted(p.name for p in (tmp_path / "out").glob("*.csv"))
    assert names == ["compare_result_step0_rank0.csv", "compare_result_step0_rank1.csv",
                     "compare_result_step1_rank0.csv", "compare_result_step1_rank1.csv"]
    # a step folder pairs its ranks too
    result = compare_dumps(tmp_path / "t/step1", tmp_path / "g/step1")
    assert [p.label for p in result.pairs] == ["rank0", "rank1"]


def test_proc_folders_pair_by_position(tmp_path):
    mlp_run(tmp_path / "g/step0/proc111")
    mlp_run(tmp_path / "t/step0/proc222", perturb=1)
    result = compare_dumps(tmp_path / "t", tmp_path / "g")
    assert result.pairs[0].divergence.target_record == "Functional.linear.1.forward"


def test_tensor_against_statistics_dump_compares_statistics(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0", task="statistics")
    mlp_run(tmp_path / "t/step0/rank0", task="tensor", perturb=2)
    pair = compare_dumps(tmp_path / "t", tmp_path / "g").pairs[0]
    assert pair.mode == "statistics" and pair.notes
    assert pair.divergence.target_record == "Functional.linear.2.forward"


def test_stack_column_and_xlsx_highlight(tmp_path):
    openpyxl = pytest.importorskip("openpyxl")
    mlp_run(tmp_path / "g/step0/rank0")
    mlp_run(tmp_path / "t/step0/rank0", perturb=1)
    rc = main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "out"),
               "--stack", "-q"])
    assert rc == 1
    ws = openpyxl.load_workbook(tmp_path / "out/compare_result.xlsx").active
    header = [c.value for c in ws[1]]
    assert header[-1] == "Target Stack"
    result_col = header.index("Result")
    for row in ws.iter_rows(min_row=2):
        colour = row[0].fill.fgColor.rgb if row[0].fill.fill_type else None
        assert (colour == "FFFFC7CE") == (row[result_col].value == ERROR)
    rows = _rows(tmp_path / "out/compare_result.csv")
    assert "line" in rows[0]["Target Stack"]


def test_thresholds_from_the_command_line(tmp_path, capsys):
    mlp_run(tmp_path / "g/step0/rank0")
    mlp_run(tmp_path / "t/step0/rank0", scale=1.0001)
    assert main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "o1"),
                 "-q"]) == 0
    assert main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "o2"),
                 "-q", "--cosine", "1.01", "--max-abs", "0"]) == 1
    capsys.readouterr()


def test_compare_never_imports_torch(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0")
    mlp_run(tmp_path / "t/step0/rank0", perturb=1)
    code = ("import sys; from msprobe_core.cli import main; "
            f"rc = main(['compare', '-t', {str(tmp_path / 't')!r}, '-g', {str(tmp_path / 'g')!r}, "
            f"'-o', {str(tmp_path / 'out')!r}, '-q']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "First divergence: Functional.linear.1.forward" in proc.stdout


def test_console_entry_point_module(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0", task="statistics")
    proc = subprocess.run([sys.executable, "-m", "msprobe_core", "compare", "-t", str(tmp_path / "g"), "-g",
                           str(tmp_path / "g"), "-o", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "No divergence" in proc.stdout
