"""Compare as msprobe users run it: ``-i compare.json`` and msprobe's result column names."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from compare_fixtures import mlp_run
from msprobe_core.cli import main
from msprobe_core.compare.msprobe_input import load_compare_input
from msprobe_core.errors import ConfigError

TENSOR_HEADER = ["NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape", "Bench Tensor Shape",
                 "Requires_grad Consistent", "Cosine", "EucDist", "MaxAbsErr", "MaxRelativeErr",
                 "One Thousandth Err Ratio", "Five Thousandths Err Ratio", "NPU max", "NPU min", "NPU mean",
                 "NPU l2norm", "Bench max", "Bench min", "Bench mean", "Bench l2norm", "Accuracy Reached or Not",
                 "Err_message"]
SUMMARY_HEADER = ["NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape", "Bench Tensor Shape",
                  "Requires_grad Consistent", "Max diff", "Min diff", "Mean diff", "L2norm diff", "MaxRelativeErr",
                  "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr", "NPU max", "NPU min", "NPU mean",
                  "NPU l2norm", "Bench max", "Bench min", "Bench mean", "Bench l2norm", "Result", "Err_message"]


def _rows(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _compare_json(tmp_path: Path, **entries) -> Path:
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(entries))
    return path


def test_compare_json_with_dump_json_paths_and_stack_path(tmp_path, capsys):
    mlp_run(tmp_path / "bench/step0/rank0", task="tensor")
    mlp_run(tmp_path / "npu/step0/rank0", task="tensor", perturb=2)
    spec = _compare_json(tmp_path, npu_path=str(tmp_path / "npu/step0/rank0/dump.json"),
                         bench_path=str(tmp_path / "bench/step0/rank0/dump.json"),
                         stack_path=str(tmp_path / "npu/step0/rank0/stack.json"), is_print_compare_log=True)
    rc = main(["compare", "-i", str(spec), "-o", str(tmp_path / "out"), "--msprobe-columns"])
    assert rc == 1
    assert capsys.readouterr().out.splitlines()[-1] == "First divergence: Functional.linear.2.forward"
    header, rows = _rows(tmp_path / "out/compare_result.csv")
    assert header == TENSOR_HEADER + ["NPU_Stack_Info", "Data_name"]   # stack_path: msprobe's -s
    first = next(r for r in rows if r["NPU Name"] == "Functional.linear.0.forward.input.0")
    assert first["Bench Name"] == first["NPU Name"] and first["Accuracy Reached or Not"] == "Yes"
    assert float(first["Cosine"]) == 1.0 and float(first["EucDist"]) == 0.0
    assert float(first["Five Thousandths Err Ratio"]) == 1.0 and first["NPU Tensor Shape"] == "[4, 8]"
    assert first["Requires_grad Consistent"] == "True"
    assert first["Data_name"] == str(["Functional.linear.0.forward.input.0.pt"] * 2)
    assert "model.py" in first["NPU_Stack_Info"]
    bad = next(r for r in rows if r["NPU Name"] == "Functional.linear.2.forward.input.1")   # the perturbed weight
    assert bad["Accuracy Reached or Not"] == "No" and bad["Err_message"]
    # EucDist is the L2 norm of the difference: here the weight's sign flipped, so 2 * |w|
    assert math.isclose(float(bad["EucDist"]), 2 * float(bad["NPU l2norm"]), rel_tol=1e-5)
    assert float(bad["MaxAbsErr"]) > 0 and float(bad["Five Thousandths Err Ratio"]) < 1
    assert (tmp_path / "out/compare_result.xlsx").is_file()


def test_compare_json_with_folders_and_quiet_log_statistics_columns(tmp_path, capsys):
    mlp_run(tmp_path / "bench/step0/rank0", task="statistics")
    mlp_run(tmp_path / "npu/step0/rank0", task="statistics", scale=1.5)
    spec = _compare_json(tmp_path, npu_path="npu", bench_path="bench", is_print_compare_log=False)
    rc = main(["compare", "-i", str(spec), "-o", str(tmp_path / "out"), "--msprobe-columns"])  # relative to the json
    assert rc == 1
    out = capsys.readouterr().out
    assert "First divergence" in out.splitlines()[-1] and len(out.splitlines()) == 2   # quiet: one line per pair
    header, rows = _rows(tmp_path / "out/compare_result.csv")
    assert header == SUMMARY_HEADER
    row = next(r for r in rows if r["NPU Name"] == "Functional.linear.0.forward.input.0")
    assert row["Result"] == "error"
    npu_max, bench_max = float(row["NPU max"]), float(row["Bench max"])
    assert math.isclose(float(row["Max diff"]), npu_max - bench_max, rel_tol=1e-9)
    assert row["MaxRelativeErr"].endswith("%")
    assert math.isclose(float(row["MaxRelativeErr"][:-1]), abs(npu_max - bench_max) / abs(bench_max) * 100, rel_tol=1e-9)
    same = next(r for r in rows if r["NPU Name"] == "Functional.linear.0.forward.input.1")   # weights equal
    assert same["Result"] == "pass" and same["NormRelativeErr"] == "0.0%"


def test_md5_and_unmatched_rows_in_msprobe_columns(tmp_path):
    mlp_run(tmp_path / "g", task="statistics", summary_mode="md5")
    mlp_run(tmp_path / "t", task="statistics", summary_mode="md5", extra_call_after=1)
    assert main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "out"),
                 "--msprobe-columns", "-q"]) == 0
    header, rows = _rows(tmp_path / "out/compare_result.csv")
    assert header == SUMMARY_HEADER[:7] + ["NPU MD5", "BENCH MD5", "Result", "Err_message"]
    extra = [r for r in rows if r["Bench Name"] == "N/A"]
    assert extra and all(r["Result"] == "N/A" and r["NPU Name"].startswith("Tensor.mul") for r in extra)
    matched = [r for r in rows if r["Bench Name"] != "N/A"]
    assert all(r["NPU MD5"] == r["BENCH MD5"] and r["Result"] == "pass" for r in matched)


def test_native_columns_are_unchanged_without_the_option(tmp_path):
    mlp_run(tmp_path / "g", task="tensor")
    mlp_run(tmp_path / "t", task="tensor")
    assert main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "out"), "-q"]) == 0
    header, _ = _rows(tmp_path / "out/compare_result.csv")
    assert header[:3] == ["Index", "Target Name", "Golden Name"] and "Five Thousandths Err Ratio" not in header


@pytest.mark.parametrize("entries,field", [
    ({"npu_path": "npu"}, "bench_path"),
    ({"npu_path": "npu", "bench_path": "missing"}, "bench_path"),
    ({"npu_path": "npu", "bench_path": "bench", "is_print_compare_log": "yes"}, "is_print_compare_log"),
    ({"npu_path": "npu", "bench_path": "bench", "npu_pth": "x"}, "npu_pth"),
    ({"npu_path": "npu/step0/rank0/construct.json", "bench_path": "bench"}, "npu_path"),
    ({"npu_path": "npu", "bench_path": "bench", "stack_path": "bench/step0/rank0/stack.json"}, "stack_path"),
])
def test_bad_compare_json_is_a_clear_error(tmp_path, entries, field, capsys):
    mlp_run(tmp_path / "bench/step0/rank0", task="statistics")
    mlp_run(tmp_path / "npu/step0/rank0", task="statistics")
    spec = _compare_json(tmp_path, **entries)
    with pytest.raises(ConfigError, match=field):
        load_compare_input(spec)
    assert main(["compare", "-i", str(spec), "-o", str(tmp_path / "out")]) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unknown_key_suggests_the_right_one(tmp_path):
    spec = _compare_json(tmp_path, npu_pth="a", bench_path="b")
    with pytest.raises(ConfigError, match="did you mean 'npu_path'"):
        load_compare_input(spec)


def test_input_file_or_target_golden_not_both(tmp_path, capsys):
    mlp_run(tmp_path / "g", task="statistics")
    spec = _compare_json(tmp_path, npu_path=str(tmp_path / "g"), bench_path=str(tmp_path / "g"))
    assert main(["compare", "-i", str(spec), "-t", str(tmp_path / "g"), "-o", str(tmp_path / "o")]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["compare", "-t", str(tmp_path / "g"), "-o", str(tmp_path / "o")]) == 2
    assert "-i compare.json" in capsys.readouterr().err


def test_nan_check_dumps_are_refused_like_overflow_check(tmp_path, capsys):
    mlp_run(tmp_path / "t", task="statistics")
    mlp_run(tmp_path / "g", task="statistics")
    doc = json.loads((tmp_path / "t/dump.json").read_text())
    (tmp_path / "t/dump.json").write_text(json.dumps({**doc, "task": "nan_check"}))
    assert main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "o")]) == 2
    assert "overflow_check" in capsys.readouterr().err


def test_stack_flag_alias_and_msprobe_output_path_option(tmp_path):
    mlp_run(tmp_path / "g", task="statistics")
    mlp_run(tmp_path / "t", task="statistics")
    assert main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "--output_path",
                 str(tmp_path / "out"), "-s", "--msprobe-columns", "-q"]) == 0
    header, rows = _rows(tmp_path / "out/compare_result.csv")
    assert header[-1] == "NPU_Stack_Info" and all(r["NPU_Stack_Info"] for r in rows)
    assert header[-2] == "Err_message"
