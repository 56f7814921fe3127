"""msprobe's own support_wrap_ops.yaml: sections for libraries this build does not hook are skipped with a
warning; the ``aten`` section records ATen operators (``Aten.addmm.default.0.forward``) through a
TorchDispatchMode, without changing a number."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dump_models import ResidualAttention, TinyNet, make_data, train_steps
from msprobe_core.errors import ConfigError
from msprobe_log import msprobe_messages
from msprobe_core.pytorch import PrecisionDebugger

PROC = f"proc{os.getpid()}"

MSPROBE_LIKE = """\
functional:
  - relu
tensor:
  - sum
torch:
  - add
_VF:
  - lstm
torch_npu:
  - npu_fusion_attention
  - npu_rms_norm
aten:
  - addmm
  - mm
  - mul.Tensor
  - relu
distributed:
  - all_reduce
npu_distributed:
  - isend
mindspeed:
  - npu_ring_attention_update
"""


def _dump(tmp_path, wrap_text, run, level="L1"):
    wrap = tmp_path / "support_wrap_ops.yaml"
    wrap.write_text(wrap_text)
    out = tmp_path / "dump"
    dbg = PrecisionDebugger({"dump_path": str(out), "level": level}, wrap_list=str(wrap))
    run(dbg)
    return json.loads((out / "step0" / PROC / "dump.json").read_text())["data"]


def _tiny_step(dbg):
    model = TinyNet()
    dbg.start(model)
    model(torch.randn(3, 8)).sum().backward()
    torch.ops.aten.mm(torch.ones(2, 3), torch.ones(3, 2))   # a direct ATen call
    dbg.stop()
    dbg.step()


def test_msprobe_wrap_list_is_accepted_and_the_skipped_sections_named(tmp_path):
    with msprobe_messages() as messages:
        data = _dump(tmp_path, MSPROBE_LIKE, _tiny_step)
    assert any("torch_npu, npu_distributed, mindspeed not hooked by this build (skipped)" in m for m in messages)
    # F.linear is not listed: its ATen operator is recorded; relu is: recorded once, as Functional
    assert "Aten.addmm.default.0.forward" in data and "Functional.relu.0.forward" in data
    assert not any(name.startswith("Aten.relu") for name in data)
    assert "Aten.mm.default.0.forward" in data   # torch.ops.aten.mm(...)
    mm = data["Aten.mm.default.0.forward"]
    assert mm["input_args"][0]["shape"] == [2, 3] and mm["output"][0]["Max"] == 3.0
    assert not any(name.startswith("Aten.") and name.endswith(".backward") for name in data)
    assert "Tensor.sum.0.forward" in data


def test_aten_records_have_msprobe_names_and_statistics(tmp_path):
    def run(dbg):
        dbg.start()
        a = torch.arange(6.0).reshape(2, 3)
        torch.ops.aten.addmm(torch.zeros(2, 2), a, a.t())
        torch.ops.aten.mul.Tensor(a, a)
        torch.ops.aten.mul.Scalar(a, 2.0)   # an overload that is not listed
        dbg.stop()
        dbg.step()

    data = _dump(tmp_path, "aten:\n  - addmm\n  - mul.Tensor\n", run)
    assert list(data) == ["Aten.addmm.default.0.forward", "Aten.mul.Tensor.0.forward"]
    rec = data["Aten.addmm.default.0.forward"]
    assert [t["shape"] for t in rec["input_args"]] == [[2, 2], [2, 3], [3, 2]]
    assert rec["output"][0]["Max"] == 50.0   # [3,4,5] . [3,4,5]


def test_aten_level_keeps_losses_and_gradients_bit_identical(tmp_path):
    torch.manual_seed(0)
    ref_losses, ref_grads = train_steps(ResidualAttention(), make_data(), 2)
    wrap = tmp_path / "ops.yaml"
    wrap.write_text("functional:\n  - gelu\naten:\n  - addmm\n  - mm\n  - bmm\n  - native_layer_norm\n  - add.Tensor\n"
                    "  - mul.Tensor\n  - _softmax\n  - mean.dim\n")
    torch.manual_seed(0)
    model = ResidualAttention()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "mix"}, wrap_list=str(wrap))
    losses, grads = train_steps(model, make_data(), 2, before=lambda i: dbg.start(model),
                                after=lambda i: (dbg.stop(), dbg.step()))
    assert losses == ref_losses
    assert all(torch.equal(a, b) for g, r in zip(grads, ref_grads) for a, b in zip(g, r))
    data = json.loads((tmp_path / "d" / "step0" / PROC / "dump.json").read_text())["data"]
    assert any(name.startswith("Aten.native_layer_norm.default.") for name in data)
    construct = json.loads((tmp_path / "d" / "step0" / PROC / "construct.json").read_text())
    assert construct["Aten.native_layer_norm.default.0.forward"] == "Module.ln.LayerNorm.forward.0"


def test_stop_leaves_no_dispatch_mode_behind(tmp_path):
    _dump(tmp_path, "aten:\n  - mm\n", _tiny_step)
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch.ops.aten.mm(torch.ones(1, 1), torch.ones(1, 1)).item() == 1.0


def test_a_section_msprobe_does_not_have_is_still_an_error(tmp_path):
    wrap = tmp_path / "ops.yaml"
    wrap.write_text("functional:\n  - relu\ntorch_npus:\n  - x\n")
    with pytest.raises(ConfigError, match="wrap_list.torch_npus.*aten.*torch_npu"):
        PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1"}, wrap_list=str(wrap))
