"""The MSAdapter dump: PyTorch-style code running on MindSpore through mindtorch (``import torch`` is
mindtorch's proxy), dumped with framework ``mindtorch`` and msprobe's names (``Module.``, ``Functional.``,
``Tensor.``, ``Torch.``), tensors as ``.npy``.

Runs only in the MSAdapter venv (``make test-msadapter``: mindtorch replaces torch, so it has a venv of its
own, and these tests run without tests/conftest.py, which imports the real torch). The last tests pin what
mindtorch itself cannot do, as the README documents it: if one starts to fail, mindtorch has changed.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mindtorch")
import mindspore as ms  # noqa: E402
import torch  # noqa: E402  (mindtorch's proxy)
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from msprobe_core.mindspore import PrecisionDebugger, seed_all  # noqa: E402


class Net(nn.Module):
    """seed 000's example network."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_features=8, out_features=4)
        self.linear2 = nn.Linear(in_features=4, out_features=2)

    def forward(self, x):
        x1 = self.linear1(x)
        x2 = self.linear2(x1)
        return F.relu(x2)


@pytest.fixture(autouse=True)
def _fresh_debugger():
    PrecisionDebugger.reset()
    yield
    PrecisionDebugger.reset()


def inputs(n: int = 3) -> list:
    rng = np.random.RandomState(0)
    return [torch.tensor(rng.randn(10, 8).astype(np.float32)) for _ in range(n)]


def train(dump_path=None, config=None, steps: int = 2):
    """seed_all, then ``steps`` steps of value_and_grad + a manual SGD update (mindtorch's optimizers and
    ``loss.backward()`` do not work); returns (losses, grads) as NumPy."""
    seed_all(1234)
    net = Net()
    params = list(net.parameters())
    dbg = PrecisionDebugger({"dump_path": str(dump_path), **(config or {})}) if dump_path else None
    fn = torch.autograd.value_and_grad(lambda x: net(x).sum(), params)
    losses, grads = [], []
    for x in inputs(steps):
        if dbg:
            dbg.start(model=net)
        loss = fn(x)
        grads.append([p.grad.numpy().copy() for p in params])
        with torch.no_grad():
            for p in params:
                p.sub_(0.1 * p.grad)
                p.grad = None
        if dbg:
            dbg.stop()
            dbg.step()
        losses.append(loss.numpy().copy())
    return losses, grads


def load(dump_path: Path, step: int = 0) -> tuple[dict, dict, Path]:
    (rank_dir,) = [Path(p) for p in glob.glob(f"{dump_path}/step{step}/*")]
    return (json.loads((rank_dir / "dump.json").read_text()), json.loads((rank_dir / "construct.json").read_text()),
            rank_dir)


def test_mix_records_names_framework_and_numbers(tmp_path):
    ref_losses, ref_grads = train()
    losses, grads = train(tmp_path / "d", {"level": "mix"})
    assert [l.tobytes() for l in losses] == [l.tobytes() for l in ref_losses]
    assert all(a.tobytes() == b.tobytes() for s, r in zip(grads, ref_grads) for a, b in zip(s, r))
    dump, construct, rank_dir = load(tmp_path / "d")
    assert (dump["framework"], dump["level"], rank_dir.name) == ("mindtorch", "mix", f"proc{os.getpid()}")
    data = dump["data"]
    for name in ("Module.linear1.Linear.forward.0", "Module.linear2.Linear.backward.0",
                 "Module.linear1.Linear.parameters_grad.0", "Functional.relu.0.forward", "Functional.relu.0.backward",
                 "Tensor.sum.0.forward"):
        assert name in data, name
    fwd = data["Module.linear1.Linear.forward.0"]
    assert set(fwd["parameters"]) == {"weight", "bias"}
    x = inputs(1)[0].numpy().astype(np.float64)
    arg = fwd["input_args"][0]
    assert (arg["type"], arg["dtype"], arg["shape"]) == ("mindspore.Tensor", "Float32", [10, 8])
    assert (arg["Max"], arg["Min"], arg["Mean"]) == pytest.approx((x.max(), x.min(), x.mean()), rel=1e-6)
    assert arg["Norm"] == pytest.approx(np.sqrt((x * x).sum()), rel=1e-6)
    assert data["Module.linear1.Linear.parameters_grad.0"]["weight"][0]["shape"] == [4, 8]
    assert construct["Functional.relu.0.forward"] is None and construct["Module.linear2.Linear.forward.0"] is None


def test_l1_names_and_tensor_files(tmp_path):
    train(tmp_path / "d", {"level": "L1", "task": "tensor"}, steps=1)
    dump, _, rank_dir = load(tmp_path / "d")
    data = dump["data"]
    assert not any(k.startswith("Module.") for k in data)
    assert {"Functional.relu.0.forward", "Functional.relu.0.backward", "Tensor.sum.0.forward"} <= set(data)
    out = data["Functional.relu.0.forward"]["output"][0]
    assert out["data_name"] == "Functional.relu.0.forward.output.0.npy"
    arr = np.load(rank_dir / "dump_tensor_data" / out["data_name"], allow_pickle=False)
    assert list(arr.shape) == out["shape"] and out["Max"] == pytest.approx(float(arr.max())) and arr.min() == 0


def test_torch_api_prefix(tmp_path):
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1"})
    a, b = inputs(2)
    dbg.start()
    c = torch.matmul(a, b.t())
    dbg.stop()
    dbg.step()
    data = load(tmp_path / "d")[0]["data"]
    assert "Torch.matmul.0.forward" in data and "Tensor.t.0.forward" in data
    assert data["Torch.matmul.0.forward"]["output"][0]["shape"] == list(c.shape) == [10, 10]


def test_seed_000_example_with_mindspore_value_and_grad(tmp_path):
    """seed 000's quick start: ms.value_and_grad(train_step, grad_position=0) over a torch-style network."""
    seed_all()
    debugger = PrecisionDebugger({"task": "statistics", "dump_path": str(tmp_path / "output"), "rank": [],
                                  "step": [0, 1], "level": "L0",
                                  "statistics": {"scope": [], "list": [], "data_mode": ["all"],
                                                 "summary_mode": "statistics"}})
    net = Net()

    def train_step(inputs):
        return net(inputs)

    grad_fn = ms.value_and_grad(train_step, grad_position=0)
    grads = []
    for x in inputs(3):
        debugger.start(model=net)
        out, grad = grad_fn(x)
        debugger.stop()
        debugger.step()
        grads.append(grad.asnumpy().astype(np.float64))  # (mindtorch's .numpy() fails on it: no device)
    assert sorted(os.listdir(tmp_path / "output")) == ["step0", "step1"]
    data = load(tmp_path / "output", 1)[0]["data"]
    bwd = data["Module.linear1.Linear.backward.0"]
    assert bwd["output"][0]["shape"] == [10, 8]  # the gradient reaching the input
    assert bwd["output"][0]["Norm"] == pytest.approx(float(np.sqrt((grads[1] ** 2).sum())), rel=1e-5)


# ---------------------------------------------------------------------------- what mindtorch cannot do
def test_mindtorch_loss_backward_is_a_no_op():
    net = Net()
    net(inputs(1)[0]).sum().backward()
    assert all(p.grad is None for p in net.parameters())


def test_mindtorch_optimizer_step_has_no_cpu_kernel():
    net = Net()
    params = list(net.parameters())
    torch.autograd.value_and_grad(lambda x: net(x).sum(), params)(inputs(1)[0])
    with pytest.raises(Exception, match="No implementation|raw_sgd|addcdiv|not support|kernel"):
        torch.optim.SGD(params, lr=0.1).step()
