"""Comparing a MindSpore dump with a PyTorch dump of the same network (real MindSpore and real torch, the
weights copied across): clean when nothing differs, and the first divergence names the layer whose weight
was perturbed on one side. Also the MindSpore-to-PyTorch mapping itself, and an MSAdapter (mindtorch) dump
against PyTorch when the MSAdapter venv is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
torch = pytest.importorskip("torch")

import ms_models as M  # noqa: E402

from msprobe_core.compare import compare_dumps  # noqa: E402
from msprobe_core.compare.framework_map import (load_mapping, ms_api_key, pt_api_name,  # noqa: E402
                                                same_dtype)
from msprobe_core.errors import ConfigError  # noqa: E402
from msprobe_core.mindspore import PrecisionDebugger as MsDebugger  # noqa: E402
from msprobe_core.pytorch import PrecisionDebugger as PtDebugger  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
MSADAPTER_PYTHON = ROOT / ".venv-msadapter" / "bin" / "python"


@pytest.fixture(autouse=True)
def _fresh_ms_debugger():
    MsDebugger.reset()
    yield
    MsDebugger.reset()


def dump_both(tmp_path: Path, level: str, task: str = "statistics", perturb: str = "") -> tuple[Path, Path]:
    """One training step of TinyNet in MindSpore and of its PyTorch twin (same weights, same batch), each
    dumped; ``perturb`` names a MindSpore Linear whose weight gets noise after the copy."""
    net, opt, grad_fn = M.build()
    model = M.torch_twin(net)
    if perturb:
        p = dict(net.cells_and_names())[perturb].weight
        noise = np.random.RandomState(1).randn(*p.shape).astype(np.float32) * 0.05
        p.set_data(p + ms.Tensor(noise))
    (x, y), = M.data(1)
    config = {"task": task, "level": level}
    msd = MsDebugger({**config, "dump_path": str(tmp_path / "ms")})
    msd.start(net)
    _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
    msd.stop()
    msd.step()
    ptd = PtDebugger({**config, "dump_path": str(tmp_path / "pt")})
    ptd.start(model)
    ((model(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2).mean().backward()
    ptd.stop()
    ptd.step()
    PtDebugger.reset()
    return tmp_path / "ms", tmp_path / "pt"


@pytest.mark.parametrize("level,task", [("L0", "statistics"), ("mix", "statistics"), ("L1", "tensor")])
def test_same_network_and_weights_compare_clean(tmp_path, level, task):
    ms_dump, pt_dump = dump_both(tmp_path, level, task)
    result = compare_dumps(ms_dump, pt_dump)
    (pair,) = result.pairs
    assert result.divergence is None, [(r.target_record, r.path, r.messages) for r in pair.rows if r.verdict == "error"]
    matched = [(t, g) for t, g in pair.merged if t and g]
    if level != "L1":  # every cell pairs with its module
        cells = {t: g for t, g in matched if t.startswith("Cell.")}
        assert cells["Cell.block.fc1.Linear.forward.0"] == "Module.block.fc1.Linear.forward.0"
        assert cells["Cell.block.norm1.LayerNorm.parameters_grad.0"] == "Module.block.norm1.LayerNorm.parameters_grad.0"
        assert len(cells) == len([n for n in pair.target.data if n.startswith("Cell.")])
    if level != "L0":  # APIs pair with their PyTorch counterparts
        apis = dict(matched)
        assert apis["Mint.matmul.0.forward"] == "Torch.matmul.0.forward"
        assert apis["MintFunctional.relu.0.backward"] == "Functional.relu.0.backward"
        assert apis["Primitive.dense.Dense.0.forward"] == "Functional.linear.0.forward"
        assert apis["Primitive.layer_norm.LayerNorm.1.forward"] == "Functional.layer_norm.1.forward"
        assert apis["Tensor.transpose.0.forward"] == "Tensor.transpose.0.forward"
    rows = {(r.target_record, r.path): r for r in pair.rows}
    if level == "L0":
        gamma = rows[("Cell.block.norm1.LayerNorm.forward.0", "parameters.weight")]  # gamma, by its PyTorch name
        assert gamma.golden_record == "Module.block.norm1.LayerNorm.forward.0" and gamma.verdict == "pass"
        assert (gamma.target["dtype"], gamma.golden["dtype"]) == ("Float32", "torch.float32")
    assert any("aligned on PyTorch names" in note for note in pair.notes)


@pytest.mark.parametrize("level", ["L0", "mix"])
def test_a_weight_perturbed_on_one_side_is_the_first_divergence(tmp_path, level):
    ms_dump, pt_dump = dump_both(tmp_path, level, perturb="block.fc1")
    div = compare_dumps(ms_dump, pt_dump).divergence
    assert div is not None
    _, first = div
    layer = first.target_record if level == "L0" else first.parent
    assert layer == "Cell.block.fc1.Linear.forward.0", (first.target_record, first.parent)
    assert first.golden_record.startswith("Module.block.fc1.Linear" if level == "L0" else "Functional.linear.")


def test_compare_cli_across_frameworks(tmp_path):
    ms_dump, pt_dump = dump_both(tmp_path, "L0", perturb="block.attn.v")
    extra = tmp_path / "mapping.yaml"
    extra.write_text("api:\n  mindspore.ops.my_op: torch.nn.functional.my_op\n")
    res = subprocess.run([sys.executable, "-m", "msprobe_core", "compare", "-t", str(ms_dump), "-g", str(pt_dump),
                          "-o", str(tmp_path / "out"), "--api-mapping", str(extra), "-q", "--no-xlsx"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 1, res.stderr
    assert "First divergence: Cell.block.attn.v.Linear.forward.0" in res.stdout
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    assert "Cell.block.attn.v.Linear.forward.0" in json.dumps(summary)


def test_mapping_table():
    assert ms_api_key("mindspore.mint.nn.functional.relu") == "MintFunctional.relu"
    assert ms_api_key("mint.matmul") == "Mint.matmul" and ms_api_key("ops.matmul") == "Functional.matmul"
    assert ms_api_key("mindspore.Tensor.astype") == "Tensor.astype" and ms_api_key("Primitive.Dense") == "Primitive.Dense"
    with pytest.raises(ConfigError, match="a MindSpore API"):
        ms_api_key("numpy.matmul")
    assert pt_api_name("torch.nn.functional.linear") == "linear" and pt_api_name("torch.Tensor.to") == "to"
    assert same_dtype("Float32", "torch.float32") and same_dtype("BFloat16", "torch.bfloat16")
    assert same_dtype("Bool", "torch.bool") and not same_dtype("Float16", "torch.float32")
    mapping = load_mapping()
    assert mapping.api_name("Primitive", "Dense") == "linear" and mapping.api_name("MintFunctional", "relu") == "relu"
    assert mapping.cell["Dense"] == "Linear" and mapping.parameters("LayerNorm") == {"gamma": "weight", "beta": "bias"}


def test_user_mapping_extends_the_shipped_table(tmp_path):
    extra = tmp_path / "m.yaml"
    extra.write_text("api:\n  ops.fused_add_norm: torch.nn.functional.layer_norm\ncell:\n  MyDense: Linear\n"
                     "parameter:\n  MyDense: {kernel: weight}\n")
    mapping = load_mapping(extra)
    assert mapping.api_name("Functional", "fused_add_norm") == "layer_norm"
    assert mapping.cell["MyDense"] == "Linear" and mapping.cell["Dense"] == "Linear"
    assert mapping.parameters("MyDense") == {"kernel": "weight"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("apis: {}\n")
    with pytest.raises(ConfigError, match="api_mapping"):
        load_mapping(bad)


MINDTORCH_RUN = r"""
import json, sys
import numpy as np
import mindtorch
import torch
import torch.nn as nn
import torch.nn.functional as F
from msprobe_core.mindspore import PrecisionDebugger

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(8, 4)
        self.linear2 = nn.Linear(4, 2)

    def forward(self, x):
        return F.relu(self.linear2(self.linear1(x)))

torch.manual_seed(0)
net = Net()
weights = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
np.savez(sys.argv[2], **weights)
x = torch.tensor(np.load(sys.argv[3]))
dbg = PrecisionDebugger({"dump_path": sys.argv[1], "level": "L0"})
fn = torch.autograd.value_and_grad(lambda x: net(x).sum(), list(net.parameters()))
dbg.start(net)
fn(x)
dbg.stop()
dbg.step()
"""


@pytest.mark.msadapter
@pytest.mark.slow
def test_msadapter_dump_compares_with_pytorch(tmp_path):
    assert MSADAPTER_PYTHON.exists(), f"no MSAdapter venv ({MSADAPTER_PYTHON}): run it with make test-msadapter"
    x = np.random.RandomState(0).randn(10, 8).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([str(MSADAPTER_PYTHON), "-c", MINDTORCH_RUN, str(tmp_path / "mt"), str(tmp_path / "w.npz"),
                    str(tmp_path / "x.npy")], check=True, env=env, timeout=600, capture_output=True)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear1 = torch.nn.Linear(8, 4)
            self.linear2 = torch.nn.Linear(4, 2)

        def forward(self, x):
            return torch.nn.functional.relu(self.linear2(self.linear1(x)))

    net = Net()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in np.load(tmp_path / "w.npz").items()})
    dbg = PtDebugger({"dump_path": str(tmp_path / "pt"), "level": "L0"})
    dbg.start(net)
    net(torch.from_numpy(x)).sum().backward()
    dbg.stop()
    dbg.step()
    result = compare_dumps(tmp_path / "mt", tmp_path / "pt")
    (pair,) = result.pairs
    assert pair.target.framework == "mindtorch" and result.divergence is None
    assert ("Module.linear2.Linear.backward.0", "Module.linear2.Linear.backward.0") in pair.merged
    assert not pair.only_target and not pair.only_golden
