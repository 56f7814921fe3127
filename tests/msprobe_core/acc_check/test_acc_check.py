"""acc_check on real L1 dumps of a small transformer in bfloat16 autocast (real torch, the project's dumper)."""

from __future__ import annotations

import csv
import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from acc_check_dumps import check_only_failure, dump_step, gpt_step, perturbed
from msprobe_core.acc_check import acc_check
from msprobe_core.acc_check.api_calls import load_dump
from msprobe_core.acc_check.results import DETAILS_HEADER, RESULT_HEADER
from msprobe_core.acc_check.standards import ERROR, PASS, judge, round_to
from msprobe_core.cli import main
from msprobe_core.dumpdir.tensor_reader import ArrayTensor
from msprobe_core.errors import DumpInputError

pytestmark = pytest.mark.slow

CORE_APIS = ("Functional.linear.0", "Torch.matmul.0", "Functional.softmax.0", "Functional.gelu.0",
             "Functional.layer_norm.0", "Functional.embedding.0", "Functional.cross_entropy.0")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """{task: dump.json} for one step of the small GPT in bf16 autocast: L1 statistics and L1 tensor."""
    root = tmp_path_factory.mktemp("acc_dumps")
    return {task: dump_step(root / task, task, gpt_step()) for task in ("statistics", "tensor")}


def _csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _header(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8") as f:
        return next(csv.reader(f))


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_healthy_bf16_model_passes(dumps, task, tmp_path):
    summary = acc_check(dumps[task], tmp_path)
    assert _header(summary.result_csv) == RESULT_HEADER
    assert _header(summary.details_csv) == DETAILS_HEADER
    assert summary.result_csv.name.startswith("accuracy_checking_result_")
    rows = {r["API Name"]: r for r in _csv(summary.result_csv)}
    assert len(rows) == len(load_dump(dumps[task]).calls)
    bad = {n: r for n, r in rows.items() if r["Forward Test Success"] != PASS or r["Backward Test Success"] == ERROR}
    assert not bad, bad
    for name in CORE_APIS:
        assert rows[name]["Forward Test Success"] == PASS
    assert rows["Functional.linear.0"]["Backward Test Success"] == PASS
    assert "autocast(bfloat16)" in rows["Functional.linear.0"]["Message"]
    assert rows["Torch.arange.0"]["Backward Test Success"] == ""  # integer output: no backward
    details = _csv(summary.details_csv)
    linear = {d["API Name"]: d for d in details if d["API Name"].startswith("Functional.linear.0.")}
    # forward output and the gradients of input, weight and bias; the float32 gradients of an autocast call
    # hold bfloat16-rounded values and are judged by the bfloat16 standard
    assert set(linear) == {"Functional.linear.0.forward.output.0"} | {
        f"Functional.linear.0.backward.output.{i}" for i in range(3)}
    grad_w = linear["Functional.linear.0.backward.output.1"]
    assert (grad_w["Bench Dtype"], grad_w["Tested Dtype"]) == ("torch.float64", "torch.float32")
    assert "bfloat16 standard" in grad_w["Message"]
    # a healthy bf16 value fails the seed's absolute bound: the dtype-aware standard is what passes it
    out = linear["Functional.linear.0.forward.output.0"]
    assert out["Tested Dtype"] == "torch.bfloat16" and float(out["MaxAbsErr"]) > 1e-4 and out["Status"] == PASS
    ln = next(d for d in details if d["API Name"] == "Functional.layer_norm.0.forward.output.0")
    assert ln["Tested Dtype"] == "torch.float32" and "standard" not in ln["Message"]  # the seed's rule


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_the_perturbed_api_is_the_one_that_fails(dumps, task, tmp_path):
    with perturbed(F, "gelu"):
        summary = acc_check(dumps[task], tmp_path, save_error_data=True)
    saved = check_only_failure(summary, "Functional.gelu.0", tmp_path, ".pt")
    inputs = torch.load(saved["forward.input"], weights_only=True)
    assert inputs["args"][0].dtype == torch.bfloat16


def test_random_inputs_are_seeded_and_match_the_statistics(dumps):
    from msprobe_core.acc_check.inputs import call_rng, random_array

    call = next(c for c in load_dump(dumps["statistics"]).calls if c.name == "Functional.linear.0")
    spec = call.input_tensors()[0]
    a = random_array(spec, call_rng(call.name))
    b = random_array(spec, call_rng(call.name))
    assert np.array_equal(a, b) and a.shape == spec.shape
    assert a.max() == np.float32(spec.max) and a.min() == np.float32(spec.min)
    ids = next(c for c in load_dump(dumps["statistics"]).calls if c.name == "Functional.embedding.0").input_tensors()[0]
    idx = random_array(ids, call_rng("x"))
    assert idx.dtype == np.int64 and idx.min() == ids.min and idx.max() == ids.max


def test_unreplayable_calls_are_listed_and_do_not_stop_the_run(tmp_path):
    import torch.distributed as dist

    custom = types.ModuleType("custom_ops")
    custom.scale = lambda x: x * 2.0

    x = torch.randn(4, 8, requires_grad=True)

    def step():
        y = F.dropout(x, p=0.5, training=True)
        z = custom.scale(y) + torch.randn(4, 8)
        w = z.detach().clone()
        w[0] = 1.0                                   # __setitem__: a write into part of a tensor
        dist.all_reduce(w)
        F.relu(z + w).sum().backward()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        dump_json = dump_step(tmp_path / "dump", "statistics", step,
                              register=lambda d: d.register_custom_api(custom, "scale", "custom_ops"))
    finally:
        dist.destroy_process_group()
    # a call whose replay raises (a dim its input does not have), and an argument the dumper could not describe
    raw = json.loads(dump_json.read_text())
    raw["data"]["Tensor.sum.0.forward"]["input_kwargs"]["dim"] = {"type": "int", "value": 5}
    raw["data"]["Tensor.clone.0.forward"]["input_args"][0]["shape"] = "4x8"
    raw["data"]["Tensor.__radd__.99.forward"] = {"input_args": [{"type": "torch.Tensor", "dtype": "torch.float32",
                                                                 "shape": [2], "Max": 1, "Min": 0}],
                                                  "input_kwargs": {"other": {"type": "Foo", "value": None}},
                                                  "output": []}
    dump_json.write_text(json.dumps(raw))
    summary = acc_check(dump_json, tmp_path / "out")
    rows = {r["API Name"]: r for r in _csv(summary.result_csv)}
    reasons = {n: r["Message"] for n, r in rows.items() if r["Forward Test Success"] == "skip"}
    assert "random op" in reasons["Functional.dropout.0"]
    assert "random op" in reasons["Torch.randn.0"]
    assert "custom API" in reasons["custom_ops.scale.0"]
    assert "distributed" in reasons["Distributed.all_reduce.0"]
    assert "in-place op on a view" in reasons["Tensor.__setitem__.0"]
    assert "replay failed" in reasons["Tensor.sum.0"] and "IndexError" in reasons["Tensor.sum.0"]
    assert "type Foo is not recorded" in reasons["Tensor.__radd__.99"]
    assert "unreadable record" in reasons["Tensor.clone.0"] and "'4x8'" in reasons["Tensor.clone.0"]
    assert rows["Functional.relu.0"]["Forward Test Success"] == PASS  # the run went on
    assert rows["Functional.relu.0"]["Backward Test Success"] == PASS


def test_unknown_framework_gets_a_clear_error(tmp_path, capsys):
    dump = {"task": "statistics", "level": "L1", "framework": "tensorflow", "data": {
        "Functional.relu.0.forward": {"input_args": [{"type": "tf.Tensor", "dtype": "float32", "shape": [4],
                                                      "Max": 1.0, "Min": -1.0}], "input_kwargs": {}, "output": []}}}
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(dump))
    with pytest.raises(DumpInputError, match="allowed: mindspore, mindtorch, pytorch"):
        acc_check(path, tmp_path / "out")
    assert main(["acc_check", "-api_info", str(path), "-o", str(tmp_path / "out")]) == 2
    assert "'framework' = 'tensorflow'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_cli_flags_and_bad_inputs(dumps, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["acc_check", "--api_info_file", str(dumps["statistics"].parent), "--out_path", str(out)]) == 0
    (result,) = out.glob("accuracy_checking_result_*.csv")
    assert "pass" in capsys.readouterr().out
    # resuming a finished run checks nothing more and leaves the files as they were
    before = result.read_text()
    assert main(["acc_check", "-api_info", str(dumps["statistics"]), "--result_csv_path", str(result)]) == 0
    assert result.read_text() == before
    assert main(["acc_check", "-api_info", str(dumps["statistics"]), "-csv_path", str(tmp_path / "x.csv")]) == 2
    assert "-csv_path" in capsys.readouterr().err
    assert main(["acc_check", "-api_info", str(tmp_path / "missing.json")]) == 2
    assert "-api_info" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["acc_check", "--help"])
    assert "-save_error_data" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rounding_matches_torch(dtype):
    values = np.random.default_rng(0).standard_normal(10_000) * 10.0 ** np.random.default_rng(1).integers(-6, 4, 10_000)
    ours = round_to(values.astype(np.float32), dtype, values.shape).values()
    theirs = torch.from_numpy(values.astype(np.float32)).to(getattr(torch, dtype)).float().numpy()
    assert np.array_equal(ours, theirs)


def test_standards():
    bench = ArrayTensor(np.linspace(-3, 3, 1000), "float64", (1000,))
    exact = round_to(bench.raw, "bfloat16", (1000,))
    assert judge(exact, bench, "bfloat16").status == PASS
    assert judge(exact, bench, "float32").status == ERROR  # the seed's absolute bound on bf16 values
    off = round_to(bench.raw * (1 + 2 ** -6), "bfloat16", (1000,))
    assert judge(off, bench, "bfloat16").status == ERROR
    f32 = ArrayTensor(bench.raw.astype(np.float32), "float32", (1000,))
    assert judge(f32, bench, "float32").status == PASS
    one_off = bench.raw.astype(np.float32).copy()
    one_off[10] += 1e-3
    verdict = judge(ArrayTensor(one_off, "float32", (1000,)), bench, "float32")
    assert verdict.status == ERROR and "MaxAbsErr" in verdict.message
    nan = bench.raw.copy()
    nan[3] = math.nan
    assert judge(ArrayTensor(nan, "float64", (1000,)), bench, "float32").status == ERROR


def test_backward_records_mark_the_inputs_that_got_a_gradient(tmp_path):
    """A dumper that marks no input requires_grad (MindSpore's functional autodiff under mindtorch): the
    backward record tells which inputs got a gradient."""
    spec = {"type": "mindspore.Tensor", "dtype": "Float32", "shape": [2, 2], "Max": 1.0, "Min": -1.0,
            "requires_grad": False}
    data = {"Torch.matmul.0.forward": {"input_args": [spec, spec], "input_kwargs": {}, "output": [spec]},
            "Torch.matmul.0.backward": {"input": [spec], "output": [spec, None]},
            "Tensor.add.0.forward": {"input_args": [spec, spec], "input_kwargs": {}, "output": [spec]}}
    path = tmp_path / "dump.json"
    path.write_text(json.dumps({"task": "statistics", "level": "L1", "framework": "mindtorch", "data": data}))
    calls = {c.name: c for c in load_dump(path).calls}
    assert [s.requires_grad for s in calls["Torch.matmul.0"].input_tensors()] == [True, False]
    assert [s.requires_grad for s in calls["Tensor.add.0"].input_tensors()] == [False, False]  # no backward record


def test_workers_take_the_costliest_calls_first(dumps, tmp_path):
    from msprobe_core.acc_check.fork_server import recorded_framework
    from msprobe_core.acc_check.workers import _work_order

    calls = load_dump(dumps["statistics"]).calls
    assert _work_order(calls, set(), 1) == calls  # one worker: the dump's order
    order = _work_order(calls, {calls[0].name}, 2)
    cost = [sum(s.numel for s in (*c.input_tensors(), *c.output_tensors())) for c in order]
    assert cost == sorted(cost, reverse=True) and sorted(c.name for c in order) == sorted(c.name for c in calls[1:])
    # the fork server is started from the framework in the file's head, before the dump is read
    assert recorded_framework(dumps["statistics"]) == "pytorch"
    (tmp_path / "other.json").write_text('{"data": {"Torch.x.0.forward": {"framework": "mindspore"}}}')
    assert recorded_framework(tmp_path / "other.json") is None
