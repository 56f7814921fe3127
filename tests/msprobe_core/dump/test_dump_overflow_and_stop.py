"""Seed behaviours of the dump: overflow_check (msprobe 26's nan_check) checks inputs and outputs and writes
the overflowing call's tensors; dump.json, stack.json and construct.json are complete after stop() once the
step's backward has run."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

from dump_models import ResidualAttention, TinyNet, make_data, train_steps
from dump_run import dump_steps
from msprobe_core.pytorch import PrecisionDebugger

PROC = f"proc{os.getpid()}"


class Mixed(nn.Module):
    """Calls whose NaN/Inf sits only in an input, only in an output, or nowhere."""

    def forward(self, x):
        clean = torch.nan_to_num(x)      # NaN in its input only
        big = torch.exp(clean * 100)     # Inf in its output only
        fine = torch.sin(clean)          # neither
        return big + fine


def _run(tmp_path, conf, model, x, backward=False):
    return dump_steps(tmp_path / "dump", model, dict({"level": "L1"}, **conf), x, backward=backward)


@pytest.mark.parametrize("task", ["overflow_check", "nan_check"])
def test_overflow_check_checks_inputs_and_outputs_and_saves_their_tensors(tmp_path, task):
    rank_dir = _run(tmp_path, {"task": task, task: {"overflow_nums": -1}}, Mixed(),
                    torch.tensor([float("nan"), 1.0, 2.0]))
    doc = json.loads((rank_dir / "dump.json").read_text())
    assert doc["task"] == "overflow_check"
    names = list(doc["data"])
    assert names[:2] == ["Torch.nan_to_num.0.forward", "Torch.exp.0.forward"]   # input NaN, output Inf
    assert "Torch.sin.0.forward" not in names
    nan_in = doc["data"]["Torch.nan_to_num.0.forward"]
    assert nan_in["input_args"][0]["data_name"] == "Torch.nan_to_num.0.forward.input.0.pt"
    saved = rank_dir / "dump_tensor_data"
    x = torch.load(saved / "Torch.nan_to_num.0.forward.input.0.pt")
    assert torch.isnan(x[0]) and x[1:].tolist() == [1.0, 2.0]
    out = torch.load(saved / nan_in["output"][0]["data_name"])
    assert torch.isfinite(out).all()
    assert torch.isinf(torch.load(saved / "Torch.exp.0.forward.output.0.pt")).any()
    assert not any(p.name.startswith("Torch.sin") for p in saved.iterdir())   # only overflowing calls' tensors
    assert doc["dump_data_dir"] == str(saved.absolute())
    assert "Torch.nan_to_num.0.forward" in json.loads((rank_dir / "stack.json").read_text())


def test_overflow_nums_counts_calls_with_input_or_output_overflow(tmp_path):
    rank_dir = _run(tmp_path, {"task": "nan_check", "nan_check": {"overflow_nums": 1}}, Mixed(),
                    torch.tensor([float("nan"), 1.0]))
    assert list(json.loads((rank_dir / "dump.json").read_text())["data"]) == ["Torch.nan_to_num.0.forward"]


def test_overflow_check_keeps_numbers_bit_identical(tmp_path):
    torch.manual_seed(0)
    ref_losses, ref_grads = train_steps(ResidualAttention(), make_data(), 2)
    torch.manual_seed(0)
    model = ResidualAttention()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "mix", "task": "nan_check"})
    losses, grads = train_steps(model, make_data(), 2, before=lambda i: dbg.start(model),
                                after=lambda i: (dbg.stop(), dbg.step()))
    assert losses == ref_losses
    assert all(torch.equal(a, b) for g, r in zip(grads, ref_grads) for a, b in zip(g, r))


def test_an_inf_gradient_is_recorded_with_its_file(tmp_path):
    class Sqrt(nn.Module):
        def forward(self, x):
            return torch.sqrt(x)   # finite forward at 0, Inf gradient there

    x = torch.tensor([0.0, 4.0], requires_grad=True)
    rank_dir = _run(tmp_path, {"task": "overflow_check"}, Sqrt(), x, backward=True)
    data = json.loads((rank_dir / "dump.json").read_text())["data"]
    backward = [name for name in data if name.endswith(".backward")]
    assert backward and not any(name.endswith(".forward") for name in data)
    files = [s["data_name"] for part in data[backward[0]].values() for s in part if s and "data_name" in s]
    assert files and all((rank_dir / "dump_tensor_data" / f).exists() for f in files)


# --------------------------------------------------------------------------------- JSON files at stop()
def _files(rank_dir):
    return {n: rank_dir / n for n in ("dump.json", "stack.json", "construct.json")}


def _records(rank_dir):
    return json.loads((rank_dir / "dump.json").read_text())["data"]


def _forward(tmp_path, level="L1", backward=True, grad=True):
    """start(), one forward (and backward) of TinyNet, stop(): (debugger, model, rank folder, loss)."""
    model = TinyNet()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "dump"), "level": level})
    dbg.start(model)
    with torch.set_grad_enabled(grad):
        loss = model(torch.randn(3, 8)).sum()
    if backward:
        loss.backward()
    dbg.stop()
    return dbg, model, tmp_path / "dump" / "step0" / PROC, loss


def test_json_files_complete_at_stop_after_the_backward(tmp_path):
    dbg, _, rank_dir, _ = _forward(tmp_path, level="mix")
    files = _files(rank_dir)
    assert all(p.exists() for p in files.values())
    data = _records(rank_dir)
    assert "Functional.linear.0.backward" in data and "Module.linear.Linear.parameters_grad.0" in data
    assert json.loads(files["construct.json"].read_text())["Functional.linear.0.forward"] == "Module.linear.Linear.forward.0"
    assert "Functional.linear.0.forward" in json.loads(files["stack.json"].read_text())
    assert (rank_dir / ".dump.journal").exists()   # a crash before step() is still recoverable
    inodes = {n: p.stat().st_ino for n, p in files.items()}
    dbg.step()
    assert not (rank_dir / ".dump.journal").exists()
    assert {n: p.stat().st_ino for n, p in files.items()} == inodes   # nothing new: not written twice
    assert _records(rank_dir).keys() == data.keys()


def test_stop_before_the_backward_leaves_the_files_to_step(tmp_path):
    dbg, _, rank_dir, loss = _forward(tmp_path, backward=False)
    assert not (rank_dir / "dump.json").exists()   # its backward records are still to come
    loss.backward()
    dbg.step()
    assert "Functional.linear.0.backward" in _records(rank_dir)


def test_forward_only_steps_are_written_at_step(tmp_path):
    """An inference loop may start()/stop() many times a step: the files are written once, at step()."""
    dbg, _, rank_dir, _ = _forward(tmp_path, backward=False, grad=False)
    assert not (rank_dir / "dump.json").exists()
    dbg.step()
    assert "Functional.linear.0.forward" in _records(rank_dir)


def test_records_after_stop_are_written_at_step(tmp_path):
    """stop() after a first backward, then another forward/backward (gradient accumulation) before step()."""
    dbg, model, rank_dir, _ = _forward(tmp_path)
    first = set(_records(rank_dir))
    dbg.start(model)
    model(torch.randn(3, 8)).sum().backward()
    dbg.stop()
    dbg.step()
    final = set(_records(rank_dir))
    assert first < final and "Functional.linear.1.backward" in final
