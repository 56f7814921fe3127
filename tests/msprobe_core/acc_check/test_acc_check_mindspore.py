"""acc_check of real MindSpore L1 dumps (MindSpore 2.10 on the CPU, the project's MindSpore dumper): a small mint
network in float16, replayed in random and real-data mode; MSAdapter (mindtorch) records through mindspore.mint."""

from __future__ import annotations

import csv
import glob
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore.nn") and __import__("mindspore")  # not a tests/ folder of that name

from mindspore import mint, nn, ops  # noqa: E402

from acc_check_dumps import check_only_failure, perturbed  # noqa: E402
from msprobe_core.acc_check import acc_check, multi_acc_check  # noqa: E402
from msprobe_core.acc_check.api_calls import load_dump  # noqa: E402
from msprobe_core.acc_check.standards import PASS, SKIP  # noqa: E402

pytestmark = pytest.mark.slow

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)


class MintNet(nn.Cell):
    """float16 linear layers and single-head attention from mint ops; softmax computed in float32, as mixed
    precision keeps it (MindSpore 2.10's float16 CPU SoftmaxGrad has 2.1-2.4x the RMSE of a correctly rounded
    result), a LayerNorm primitive and dropout (mindspore.ops: mint's has no CPU kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = mint.nn.Linear(8, 16)
        self.k = mint.nn.Linear(8, 16)
        self.norm = nn.LayerNorm((16,))
        self.fc = mint.nn.Linear(16, 4)

    def construct(self, x):
        q, k = self.q(x), self.k(x)
        scores = mint.matmul(q, k.transpose(-2, -1)) * 0.25
        weights = mint.nn.functional.softmax(scores.astype(ms.float32), dim=-1).astype(ms.float16)
        h = self.norm(mint.matmul(weights, q))
        h = ops.dropout(h, p=0.1, training=True)  # mint's DropoutExt has no CPU kernel
        return self.fc(mint.nn.functional.relu(h))


def dump_step(path: Path, task: str) -> Path:
    """One value_and_grad step of MintNet in float16 dumped at L1; the dump.json."""
    from msprobe_core.mindspore import PrecisionDebugger

    ms.set_seed(0)
    net = MintNet()
    for p in net.get_parameters():
        p.set_dtype(ms.float16)
    rng = np.random.RandomState(0)
    x, y = ms.Tensor(rng.randn(2, 5, 8), ms.float16), ms.Tensor(rng.randn(2, 5, 4), ms.float32)
    grad_fn = ms.value_and_grad(lambda a, b: ((net(a).astype(ms.float32) - b) ** 2).mean(), None,
                                net.trainable_params())
    PrecisionDebugger.reset()
    try:
        dbg = PrecisionDebugger({"dump_path": str(path), "level": "L1", "task": task})
        dbg.start(net)
        grad_fn(x, y)
        dbg.stop()
        dbg.step()
    finally:
        PrecisionDebugger.reset()
    (found,) = glob.glob(str(path / "step0" / "*" / "dump.json"))
    return Path(found)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc_ms")
    return {task: dump_step(root / task, task) for task in ("statistics", "tensor")}


def _rows(path: Path) -> dict[str, dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return {r["API Name"]: r for r in csv.DictReader(f)}


STANDARD = ("Primitive.dense.Dense.0", "Mint.matmul.0", "Mint.matmul.1", "MintFunctional.softmax.0",
            "MintFunctional.relu.0", "Tensor.__mul__.0", "Tensor.astype.0", "Tensor.transpose.0", "Tensor.mean.0")


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_healthy_float16_mint_network_passes(dumps, task, tmp_path):
    dump = load_dump(dumps[task])
    assert dump.framework == "mindspore" and dump.has_tensor_data == (task == "tensor")
    summary = acc_check(dumps[task], tmp_path)
    rows = _rows(summary.result_csv)
    assert set(rows) == {c.name for c in dump.calls}
    assert summary.failed == []
    for name in STANDARD:
        assert rows[name]["Forward Test Success"] == PASS, rows[name]
        assert rows[name]["Backward Test Success"] == PASS, rows[name]
    assert "random op" in rows["Functional.dropout.0"]["Message"]
    assert "attributes (begin_norm_axis" in rows["Primitive.layer_norm.LayerNorm.0"]["Message"]
    assert {n for n, r in rows.items() if r["Forward Test Success"] == SKIP} == {
        "Functional.dropout.0", "Primitive.layer_norm.LayerNorm.0"}
    with open(summary.details_csv, newline="", encoding="utf-8") as f:
        details = {d["API Name"]: d for d in csv.DictReader(f)}
    out = details["Mint.matmul.0.forward.output.0"]
    assert (out["Bench Dtype"], out["Tested Dtype"], out["Status"]) == ("Float64", "Float16", PASS)
    assert "float16 standard" in out["Message"]
    grad = details["Mint.matmul.0.backward.output.1"]  # the gradient of k's transpose
    assert grad["Tested Dtype"] == "Float16" and grad["Status"] == PASS
    softmax = details["MintFunctional.softmax.0.forward.output.0"]
    assert softmax["Tested Dtype"] == "Float32" and "standard" not in softmax["Message"]  # the seed's rule


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_the_perturbed_api_is_the_one_that_fails(dumps, task, tmp_path):
    with perturbed(mint.nn.functional, "relu"):
        summary = acc_check(dumps[task], tmp_path, save_error_data=True)
    saved = check_only_failure(summary, "MintFunctional.relu.0", tmp_path, ".0.npy")
    tested = np.load(saved["forward.output.tested"])
    assert tested.dtype == np.float16


def test_calls_without_a_kernel_are_listed_with_the_reason(dumps, tmp_path):
    raw = json.loads(dumps["statistics"].read_text())
    spec = {"type": "mindspore.Tensor", "dtype": "Float16", "shape": [2, 8], "Max": 1.0, "Min": -1.0,
            "requires_grad": True}
    raw["data"].update({
        "MintFunctional.gelu.0.forward": {"input_args": [spec], "input_kwargs": {}, "output": [spec]},
        "Mint.var.0.forward": {"input_args": [dict(spec, dtype="Float32")], "input_kwargs": {"dim": {"type": "int", "value": 1}},
                               "output": [dict(spec, dtype="Float32", shape=[2])]},
        "Distributed.all_reduce.0.forward": {"input_args": [spec], "input_kwargs": {}, "output": [spec]},
        "Jit.construct.0.forward": {"input_args": [spec], "input_kwargs": {}, "output": [spec]},
        "Mint.no_such_api.0.forward": {"input_args": [spec], "input_kwargs": {}, "output": [spec]}})
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(raw))
    rows = _rows(acc_check(path, tmp_path / "out").result_csv)
    reasons = {n: r["Message"] for n, r in rows.items() if r["Forward Test Success"] == SKIP}
    assert "GeluExt" in reasons["MintFunctional.gelu.0"]
    assert "Var" in reasons["Mint.var.0"]
    assert "distributed" in reasons["Distributed.all_reduce.0"]
    assert "mindspore.jit graph" in reasons["Jit.construct.0"]
    assert "custom API" in reasons["Mint.no_such_api.0"]
    assert rows["Mint.matmul.0"]["Forward Test Success"] == PASS  # the run went on


def test_mindtorch_records_replay_through_mint(tmp_path):
    def tensor(shape, dtype="Float32", grad=True):
        return {"type": "mindspore.Tensor", "dtype": dtype, "shape": shape, "Max": 1.0, "Min": -1.0,
                "requires_grad": grad}

    data = {
        "Functional.linear.0.forward": {"input_args": [tensor([4, 8]), tensor([3, 8]), tensor([3])],
                                        "input_kwargs": {}, "output": [tensor([4, 3])]},
        "Functional.linear.0.backward": {"input": [tensor([4, 3], grad=False)], "output": []},
        "Torch.matmul.0.forward": {"input_args": [tensor([4, 8]), tensor([8, 2])], "input_kwargs": {},
                                   "output": [tensor([4, 2])]},
        "Tensor.view.0.forward": {"input_args": [tensor([4, 8]), {"type": "torch.Size", "value": [32]}],
                                  "input_kwargs": {}, "output": [tensor([32])]},
        "Torch.no_such_api.0.forward": {"input_args": [tensor([4])], "input_kwargs": {}, "output": [tensor([4])]},
        "VF.lstm.0.forward": {"input_args": [tensor([4])], "input_kwargs": {}, "output": [tensor([4])]}}
    path = tmp_path / "dump.json"
    path.write_text(json.dumps({"task": "statistics", "level": "L1", "framework": "mindtorch", "data": data}))
    rows = _rows(acc_check(path, tmp_path / "out").result_csv)
    for name in ("Functional.linear.0", "Torch.matmul.0", "Tensor.view.0"):
        assert rows[name]["Forward Test Success"] == PASS, rows[name]
    assert rows["Functional.linear.0"]["Backward Test Success"] == PASS
    assert "no MindSpore equivalent" in rows["Torch.no_such_api.0"]["Message"]
    assert "no MindSpore equivalent" in rows["VF.lstm.0"]["Message"]


ROOT = Path(__file__).resolve().parents[3]
MSADAPTER_PYTHON = ROOT / ".venv-msadapter" / "bin" / "python"
MINDTORCH_STEP = r"""
import sys
import mindtorch  # noqa: F401  (installs the torch proxy)
import numpy as np
import torch
import torch.nn.functional as F
from msprobe_core.mindspore import PrecisionDebugger, seed_all

seed_all(0)
q, fc = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)


def loss(x):  # single-head attention, layer norm and a linear head
    h = q(x)
    weights = F.softmax(torch.matmul(h, h.transpose(-2, -1)) * 0.25, dim=-1)
    return fc(F.relu(F.layer_norm(torch.matmul(weights, h), (16,)))).pow(2).mean()


step = torch.autograd.value_and_grad(loss, [*q.parameters(), *fc.parameters()])
dbg = PrecisionDebugger({"dump_path": sys.argv[1], "level": "L1", "task": sys.argv[2]})
dbg.start()
step(torch.tensor(np.random.RandomState(0).randn(2, 5, 8).astype(np.float32)))
dbg.stop()
dbg.step()
"""


@pytest.mark.msadapter
@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_real_msadapter_dump_replays(task, tmp_path):
    """A real MSAdapter dump (PyTorch-style code on mindtorch, ``torch.autograd.value_and_grad``, made in the
    MSAdapter venv): every call replays and passes, forward and backward, or is listed with its reason."""
    assert MSADAPTER_PYTHON.exists(), f"no MSAdapter venv ({MSADAPTER_PYTHON}): run it with make test-msadapter"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([str(MSADAPTER_PYTHON), "-c", MINDTORCH_STEP, str(tmp_path / "d"), task], cwd=ROOT, env=env,
                   check=True, capture_output=True, text=True, timeout=600)
    (path,) = glob.glob(str(tmp_path / "d" / "step0" / "*" / "dump.json"))
    dump = load_dump(path)
    assert (dump.framework, dump.has_tensor_data) == ("mindtorch", task == "tensor")
    summary = acc_check(path, tmp_path / "out")
    rows = _rows(summary.result_csv)
    assert list(rows) == [c.name for c in dump.calls]
    assert not summary.failed
    for name, row in rows.items():
        assert row["Forward Test Success"] == PASS or (row["Forward Test Success"] == SKIP and row["Message"]), row
    for name in ("Torch.matmul.0", "Torch.matmul.1", "Functional.softmax.0", "Functional.relu.0", "Tensor.mean.0"):
        # the dumper marks no input requires_grad under value_and_grad: the backward records tell which got one
        assert (rows[name]["Forward Test Success"], rows[name]["Backward Test Success"]) == (PASS, PASS), rows[name]


def test_multi_acc_check_two_workers(dumps, tmp_path):
    result = multi_acc_check(dumps["tensor"], [0, 1], tmp_path)
    assert result.complete, result.died
    names = [n for w in result.workers for n in _rows(w.result_csv)]
    assert sorted(names) == sorted(c.name for c in load_dump(dumps["tensor"]).calls)
    assert not [n for w in result.workers for n in w.failed]
