"""What the dump records, in msprobe's format: L0, L1, mix, tasks, dtypes, filters."""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch
import torch.nn as nn

from dump_models import TinyNet
from dump_run import dump_steps
from dump_walk import saved_summaries
from msprobe_core.pytorch import PrecisionDebugger


def run_once(tmp_path, model, conf, inputs=None, steps=1, backward=True):
    torch.manual_seed(0)
    x = inputs if inputs is not None else torch.randn(3, 8)
    return dump_steps(tmp_path / "dump", model, conf, x, steps, backward)


def load(rank_dir, name="dump.json"):
    return json.loads((rank_dir / name).read_text())


def test_l0_records_names_and_fields(tmp_path):
    rank_dir = run_once(tmp_path, TinyNet(), {"level": "L0"})
    doc = load(rank_dir)
    assert (doc["task"], doc["level"], doc["framework"]) == ("statistics", "L0", "pytorch")
    data = doc["data"]
    assert list(data)[:4] == ["Module.linear.Linear.forward.0", "Module.block.Sequential.forward.0",
                              "Module.block.0.Linear.forward.0", "Module.block.1.ReLU.forward.0"]
    assert not any(k.startswith("Module.TinyNet") for k in data)  # the root passed in is not dumped
    fwd = data["Module.linear.Linear.forward.0"]
    assert set(fwd) == {"input_args", "input_kwargs", "output", "parameters"}
    t = fwd["input_args"][0]
    assert t["type"] == "torch.Tensor" and t["dtype"] == "torch.float32" and t["shape"] == [3, 8]
    assert set(t) >= {"Max", "Min", "Mean", "Norm", "requires_grad"}
    assert set(fwd["parameters"]) == {"weight", "bias"} and fwd["parameters"]["weight"]["requires_grad"] is True
    bwd = data["Module.linear.Linear.backward.0"]
    assert set(bwd) == {"input", "output"} and bwd["input"][0]["shape"] == [3, 4]
    pg = data["Module.linear.Linear.parameters_grad.0"]
    assert set(pg) == {"weight", "bias"} and pg["weight"][0]["shape"] == [4, 8]
    construct = load(rank_dir, "construct.json")
    assert construct["Module.block.0.Linear.forward.0"] == "Module.block.Sequential.forward.0"
    assert construct["Module.linear.Linear.forward.0"] is None
    stack = load(rank_dir, "stack.json")
    assert any("test_dump_records.py" in line for line in stack["Module.linear.Linear.forward.0"])


def test_statistics_values_are_exact(tmp_path):
    model = TinyNet()
    x = torch.randn(3, 8)
    rank_dir = run_once(tmp_path, model, {"level": "L0"}, inputs=x)
    rec = load(rank_dir)["data"]["Module.linear.Linear.forward.0"]
    out = model.linear(x).detach()
    s = rec["output"][0]
    assert s["Max"] == pytest.approx(out.max().item(), rel=1e-6)
    assert s["Min"] == pytest.approx(out.min().item(), rel=1e-6)
    assert s["Mean"] == pytest.approx(out.mean().item(), rel=1e-5, abs=1e-7)
    assert s["Norm"] == pytest.approx(out.norm().item(), rel=1e-6)


def test_list_of_models_gets_index_prefix(tmp_path):
    out = tmp_path / "dump"
    a, b = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 2))
    dbg = PrecisionDebugger({"dump_path": str(out), "level": "L0"})
    dbg.start([a, b])
    b(a(torch.randn(2, 4))).sum().backward()
    dbg.stop()
    dbg.step()
    data = load(out / "step0" / f"proc{os.getpid()}")["data"]
    assert "Module.0.0.Linear.forward.0" in data and "Module.1.0.Linear.forward.0" in data


def test_l1_names_nesting_and_backward(tmp_path):
    rank_dir = run_once(tmp_path, TinyNet(), {"level": "L1"})
    data = load(rank_dir)["data"]
    names = list(data)
    assert "Functional.linear.0.forward" in names and "Functional.linear.1.forward" in names
    assert "Functional.relu.0.forward" in names and "Functional.relu.1.forward" in names
    assert "Functional.linear.0.backward" in names and "Functional.relu.1.backward" in names
    rec = data["Functional.linear.0.forward"]
    assert set(rec) == {"input_args", "input_kwargs", "output"} and len(rec["input_args"]) == 3
    # nothing nested (F.layer_norm calls torch.layer_norm, F.linear is a leaf) and no tool-internal calls
    assert not any(n.startswith(("Torch.aminmax", "Torch.stack", "Torch.ones_like")) for n in names)
    assert load(rank_dir, "construct.json") == {}
    b = data["Functional.relu.1.backward"]
    assert b["input"][0]["shape"] == [3, 4] and b["output"][0]["shape"] == [3, 4]


def test_api_inside_recorded_api_is_not_recorded_twice(tmp_path):
    model = nn.LayerNorm(8)
    rank_dir = run_once(tmp_path, model, {"level": "L1"})
    names = list(load(rank_dir)["data"])
    assert "Functional.layer_norm.0.forward" in names
    assert not any(n.startswith("Torch.layer_norm") for n in names)


def test_mix_construct_links_apis_to_modules(tmp_path):
    rank_dir = run_once(tmp_path, TinyNet(), {"level": "mix"})
    data = load(rank_dir)["data"]
    assert "Module.linear.Linear.forward.0" in data and "Functional.linear.0.forward" in data
    construct = load(rank_dir, "construct.json")
    assert construct["Functional.linear.0.forward"] == "Module.linear.Linear.forward.0"
    assert construct["Functional.linear.1.forward"] == "Module.block.0.Linear.forward.0"
    assert construct["Functional.relu.1.forward"] is None
    assert construct["Functional.linear.0.backward"] == "Module.linear.Linear.backward.0"


def test_tensor_task_files_and_md5(tmp_path):
    model = TinyNet()
    x = torch.randn(3, 8)
    rank_dir = run_once(tmp_path, model, {"level": "L1", "task": "tensor"}, inputs=x)
    doc = load(rank_dir)
    assert doc["dump_data_dir"] == str((rank_dir / "dump_tensor_data").absolute())
    rec = doc["data"]["Functional.linear.0.forward"]
    assert rec["input_args"][0]["data_name"] == "Functional.linear.0.forward.input.0.pt"
    assert rec["output"][0]["data_name"] == "Functional.linear.0.forward.output.0.pt"
    saved = torch.load(rank_dir / "dump_tensor_data" / rec["input_args"][0]["data_name"])
    assert torch.equal(saved, x)
    out = torch.load(rank_dir / "dump_tensor_data" / rec["output"][0]["data_name"])
    assert torch.equal(out, model.linear(x).detach())
    grad_name = doc["data"]["Functional.linear.0.backward"]["input"][0]["data_name"]
    assert grad_name == "Functional.linear.0.backward.input.0.pt" and (rank_dir / "dump_tensor_data" / grad_name).exists()
    # every data_name exists
    names = [s["data_name"] for s in saved_summaries(doc["data"])]
    assert names and all((rank_dir / "dump_tensor_data" / n).exists() for n in names)


def test_md5_is_crc32_of_the_bytes(tmp_path):
    x = torch.randn(3, 8)
    model = nn.Linear(8, 4)
    rank_dir = run_once(tmp_path, nn.Sequential(model), {"level": "L1", "statistics": {"summary_mode": "md5"}}, inputs=x)
    rec = load(rank_dir)["data"]["Functional.linear.0.forward"]
    assert rec["input_args"][0]["md5"] == f"{zlib.crc32(x.numpy().tobytes()):08x}"
    assert len(rec["output"][0]["md5"]) == 8


def test_structure_task_has_no_statistics(tmp_path):
    rank_dir = run_once(tmp_path, TinyNet(), {"level": "mix", "task": "structure"})
    rec = load(rank_dir)["data"]["Functional.linear.0.forward"]
    assert rec["output"][0]["Max"] is None and rec["output"][0]["shape"] == [3, 4]
    assert load(rank_dir, "construct.json")["Functional.linear.0.forward"] == "Module.linear.Linear.forward.0"


def test_overflow_check_records_only_inf_nan_calls(tmp_path):
    class M(nn.Module):
        def forward(self, x):
            a = torch.exp(x)          # overflows for x = 100
            b = torch.sin(x)          # finite
            return a + b
    rank_dir = run_once(tmp_path, M(), {"level": "L1", "task": "overflow_check", "overflow_check": {"overflow_nums": -1}},
                        inputs=torch.tensor([1.0, 100.0, 1000.0]), backward=False)
    names = list(load(rank_dir)["data"])
    assert "Torch.exp.0.forward" in names and "Tensor.__add__.0.forward" in names
    assert "Torch.sin.0.forward" not in names


def test_dtype_and_shape_edge_cases(tmp_path):
    class M(nn.Module):
        def forward(self, x):
            ints = torch.arange(6).reshape(2, 3)
            flags = ints > 2
            c = torch.complex(x[:3], x[3:6])
            empty = x[:0]
            nc = x.reshape(2, 4).t()           # non-contiguous
            bad = torch.log(x - 10)             # NaN
            inf = torch.div(x + 1, 0.0)         # Inf
            return (torch.add(ints, 1), torch.logical_not(flags), torch.abs(c), torch.neg(empty),
                    torch.mul(nc, 2), torch.exp(bad), torch.sub(inf, 1))
    x = torch.arange(8, dtype=torch.float32)
    rank_dir = run_once(tmp_path, M(), {"level": "L1", "statistics": {"summary_mode": "md5"}}, inputs=x, backward=False)
    text = (rank_dir / "dump.json").read_text()
    data = json.loads(text)["data"]
    ints = data["Torch.add.0.forward"]["output"][0]
    assert ints["dtype"] == "torch.int64" and ints["Max"] == 6 and ints["Min"] == 1 and ints["Mean"] == pytest.approx(3.5)
    flags = data["Torch.logical_not.0.forward"]["output"][0]
    assert flags["dtype"] == "torch.bool" and flags["Max"] is True and flags["Min"] is False and flags["Mean"] is None
    assert data["Torch.abs.0.forward"]["input_args"][0]["dtype"] == "torch.complex64"
    empty = data["Torch.neg.0.forward"]["output"][0]
    assert empty["shape"] == [0] and empty["Max"] is None and empty["md5"] == "00000000"
    nc = data["Torch.mul.0.forward"]["input_args"][0]
    assert nc["shape"] == [4, 2] and nc["md5"] == f"{zlib.crc32(x.reshape(2, 4).t().contiguous().numpy().tobytes()):08x}"
    nan_rec = data["Torch.exp.0.forward"]["output"][0]
    assert nan_rec["Max"] != nan_rec["Max"]  # NaN survives the JSON round trip
    inf_rec = data["Torch.sub.0.forward"]["input_args"][0]
    assert inf_rec["Max"] == float("inf")


def test_data_mode_scope_list_and_tensor_list(tmp_path):
    model = TinyNet()
    d = run_once(tmp_path / "a", model, {"level": "L1", "statistics": {"data_mode": ["forward", "input"]}})
    data = load(d)["data"]
    assert not any(k.endswith("backward") for k in data)
    assert all(v["output"] == [] for v in data.values())
    PrecisionDebugger.reset()
    d = run_once(tmp_path / "b", model, {"level": "L1", "statistics": {"list": ["relu"]}})
    assert set(load(d)["data"]) == {"Functional.relu.0.forward", "Functional.relu.1.forward",
                                     "Functional.relu.0.backward", "Functional.relu.1.backward"}
    PrecisionDebugger.reset()
    d = run_once(tmp_path / "c", model, {"level": "L1", "statistics": {"scope": ["Functional.linear.1.forward", "Functional.relu.0.forward"]}})
    fwd = [k for k in load(d)["data"] if k.endswith("forward")]
    assert fwd == ["Functional.linear.1.forward", "Functional.relu.0.forward"]
    PrecisionDebugger.reset()
    d = run_once(tmp_path / "e", model, {"level": "L1", "statistics": {"tensor_list": ["Functional.relu.1"]}})
    data = load(d)["data"]
    assert data["Functional.relu.1.forward"]["output"][0]["data_name"] == "Functional.relu.1.forward.output.0.pt"
    assert "data_name" not in data["Functional.linear.0.forward"]["output"][0]
    assert (d / "dump_tensor_data" / "Functional.relu.1.forward.output.0.pt").exists()


def test_steps_rank_filter_and_set_init_step(tmp_path):
    model = TinyNet()
    out = tmp_path / "dump"
    dbg = PrecisionDebugger({"dump_path": str(out), "level": "L1", "step": [5, "7-8"]})
    dbg.set_init_step(4)
    for _ in range(6):
        dbg.start(model)
        model(torch.randn(2, 8)).sum().backward()
        dbg.stop()
        dbg.step()
    assert sorted(p.name for p in out.iterdir()) == ["step5", "step7", "step8"]
    PrecisionDebugger.reset()
    out2 = tmp_path / "dump2"
    dbg = PrecisionDebugger({"dump_path": str(out2), "level": "L1", "rank": [3]})
    dbg.start(model, rank_id=1)
    model(torch.randn(2, 8))
    dbg.stop()
    dbg.step()
    assert not out2.exists()
    PrecisionDebugger.reset()
    dbg = PrecisionDebugger({"dump_path": str(out2), "level": "L1", "rank": [3]})
    dbg.start(model, rank_id=3)
    model(torch.randn(2, 8))
    dbg.stop()
    dbg.step()
    assert (out2 / "step0" / "rank3" / "dump.json").exists()


def test_never_overwrites_another_runs_dump(tmp_path):
    model = TinyNet()
    out = tmp_path / "dump"
    dbg = PrecisionDebugger({"dump_path": str(out), "level": "L1"})
    dbg.start(model, rank_id=0)
    model(torch.randn(2, 8))
    dbg.stop()
    dbg.step()
    before = (out / "step0" / "rank0" / "dump.json").read_bytes()
    PrecisionDebugger.reset()
    dbg = PrecisionDebugger({"dump_path": str(out), "level": "L1"})
    with pytest.raises(ValueError, match="already holds a dump for rank0"):
        dbg.start(model, rank_id=0)
    assert (out / "step0" / "rank0" / "dump.json").read_bytes() == before


def test_default_dump_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = TinyNet()
    dbg = PrecisionDebugger()
    assert (dbg.config.level, dbg.config.task) == ("L1", "statistics")
    dbg.start(model)
    model(torch.randn(2, 8))
    dbg.stop()
    dbg.step()
    assert (tmp_path / "msprobe_dump" / "step0" / f"proc{os.getpid()}" / "dump.json").exists()


def test_module_dump_only_dumps_that_module(tmp_path):
    from msprobe_core.pytorch import module_dump, module_dump_end
    model = TinyNet()
    out = tmp_path / "dump"
    dbg = PrecisionDebugger({"dump_path": str(out), "level": "L1"})
    dbg.start()
    x = torch.sigmoid(torch.randn(2, 8))
    module_dump(model, "MyNet")
    y = model(x)
    module_dump_end()
    loss = torch.sum(y)
    loss.backward()
    dbg.stop()
    dbg.step()
    names = list(load(out / "step0" / f"proc{os.getpid()}")["data"])
    assert "Module.MyNet.TinyNet.forward.0" in names and "Module.MyNet.TinyNet.backward.0" in names
    assert "Torch.sigmoid.0.forward" in names and "Torch.sum.0.forward" in names
    assert not any("linear" in n or "relu" in n for n in names)


def test_save_debug_json(tmp_path):
    from msprobe_core.pytorch import save
    out = tmp_path / "dump"
    PrecisionDebugger(dump_path=str(out), level="debug", task="tensor")
    x = torch.randn(3, requires_grad=True)
    for _ in range(2):
        y = x * 2
        save({"y": y, "n": 3, "l": [y + 1, "s"]}, "var")
        save(y, "single")
        y.sum().backward()
    PrecisionDebugger.step()
    rank_dir = out / "step0" / f"proc{os.getpid()}"
    doc = load(rank_dir, "debug.json")
    assert doc["level"] == "debug"
    data = doc["data"]
    assert set(data) >= {"var.0.debug", "var.1.debug", "single.0.debug", "single.1.debug", "single_grad.0.debug", "var_grad.0.debug"}
    assert data["var.0.debug"]["n"] == {"type": "int", "value": 3}
    assert data["var.0.debug"]["l"][1] == {"type": "str", "value": "s"}
    assert data["var.0.debug"]["y"]["data_name"] == "var.0.debug.y.pt"
    assert data["single_grad.0.debug"]["Max"] == 1.0
    assert data["var_grad.0.debug"]["y"]["Max"] == 1.0
    assert (rank_dir / "dump_tensor_data" / "var.0.debug.l.0.pt").exists()


def test_register_custom_api(tmp_path):
    import types
    mod = types.ModuleType("module_a")
    mod.compute = lambda a, b: a * b + 1
    out = tmp_path / "dump"
    dbg = PrecisionDebugger({"dump_path": str(out), "level": "L1"})
    original = mod.compute
    dbg.register_custom_api(mod, "compute")
    dbg.start()
    mod.compute(torch.ones(2), torch.ones(2))
    dbg.stop()
    dbg.step()
    dbg.restore_custom_api(mod, "compute")
    assert mod.compute is original
    names = list(load(out / "step0" / f"proc{os.getpid()}")["data"])
    assert "module_a.compute.0.forward" in names
    assert "Tensor.__mul__.0.forward" not in names  # nested inside the custom API


def test_cross_file_class_level_start_stop(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            PrecisionDebugger.start()
            h = self.l1(x)
            PrecisionDebugger.stop()
            return self.l2(h)
    out = tmp_path / "dump"
    PrecisionDebugger({"dump_path": str(out), "level": "L1"})
    M()(torch.randn(2, 4))
    PrecisionDebugger.step()
    names = [n for n in load(out / "step0" / f"proc{os.getpid()}")["data"] if n.endswith("forward")]
    assert names == ["Functional.linear.0.forward"]


def test_async_dump_writes_the_same_records(tmp_path):
    model = TinyNet()
    x = torch.randn(3, 8)
    sync = load(run_once(tmp_path / "s", model, {"level": "mix"}, inputs=x))["data"]
    PrecisionDebugger.reset()
    rank_dir = run_once(tmp_path / "a", model, {"level": "mix", "async_dump": True}, inputs=x)
    assert load(rank_dir)["data"] == sync
    assert not (rank_dir / ".dump.journal").exists()


def test_async_dump_does_not_wait_for_tensor_files(tmp_path):
    """async_dump: step() returns without waiting for the writer; every file is there once it is closed."""
    model = TinyNet()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "task": "tensor", "async_dump": True})
    for _ in range(2):
        dbg.start(model)
        model(torch.randn(3, 8)).sum().backward()
        dbg.stop()
        dbg.step()
    dbg.service.close()
    for step in ("step0", "step1"):
        rank_dir = tmp_path / step / f"proc{os.getpid()}"
        names = [v["data_name"] for rec in load(rank_dir)["data"].values() for v in _summaries(rec) if "data_name" in v]
        assert names
        for name in names:
            torch.load(rank_dir / "dump_tensor_data" / name, weights_only=True)


def _summaries(obj):
    if isinstance(obj, dict):
        if obj.get("type") == "torch.Tensor":
            yield obj
        else:
            for v in obj.values():
                yield from _summaries(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _summaries(v)


def test_own_wrap_list_yaml(tmp_path):
    wrap = tmp_path / "ops.yaml"
    wrap.write_text("functional:\n  - relu\n")
    out = tmp_path / "dump"
    model = TinyNet()
    dbg = PrecisionDebugger({"dump_path": str(out), "level": "L1"}, wrap_list=str(wrap))
    dbg.start(model)
    model(torch.randn(2, 8)).sum().backward()
    dbg.stop()
    dbg.step()
    names = set(load(out / "step0" / f"proc{os.getpid()}")["data"])
    assert names == {"Functional.relu.0.forward", "Functional.relu.1.forward",
                     "Functional.relu.0.backward", "Functional.relu.1.backward"}


def test_bad_wrap_list_is_a_clear_error(tmp_path):
    wrap = tmp_path / "ops.yaml"
    wrap.write_text("functionals:\n  - relu\n")
    with pytest.raises(ValueError, match="wrap_list.functionals.*allowed: functional, tensor, torch, _VF, distributed"):
        PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1"}, wrap_list=str(wrap))
    assert not (tmp_path / "d").exists()


def test_tool_errors_go_to_dump_error_info_log_and_training_goes_on(tmp_path, monkeypatch):
    from msprobe_core.pytorch import summarize

    model = TinyNet()
    x = torch.randn(3, 8)
    ref = model(x).sum()
    calls = {"n": 0}

    def flaky(original):  # the 3rd summary the dump makes fails, whichever route makes it (a dict or its text)
        def summary(self, *args):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("boom")
            return original(self, *args)
        return summary

    monkeypatch.setattr(summarize.Summarizer, "tensor", flaky(summarize.Summarizer.tensor))
    monkeypatch.setattr(summarize.Summarizer, "tensor_text", flaky(summarize.Summarizer.tensor_text))
    from msprobe_core.pytorch import api_fast
    monkeypatch.setattr(api_fast, "_ApiGrad", None)  # the model's calls through the Python summaries (not the C route)
    rank_dir = run_once(tmp_path, model, {"level": "L1"}, inputs=x)
    assert "boom" in (rank_dir / "dump_error_info.log").read_text()
    assert (rank_dir / "dump.json").exists()
    assert torch.equal(model(x).sum(), ref)


def test_second_backward_over_a_sealed_record_fills_it_again(tmp_path):
    """Backward and parameter-gradient records are held as JSON text once complete; a second backward over the
    same graph (retain_graph) writes their fields again, as it did before they were sealed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    dbg = PrecisionDebugger({"task": "statistics", "dump_path": str(tmp_path / "dump"), "level": "mix"})
    dbg.start(model)
    loss = model(torch.randn(2, 4)).sum()
    loss.backward(retain_graph=True)
    first = {k: p.grad.clone() for k, p in model.named_parameters()}
    loss.backward()
    dbg.stop()
    dbg.step()
    (rank_dir,) = (tmp_path / "dump" / "step0").iterdir()
    data = load(rank_dir)["data"]
    weight = data["Module.0.Linear.parameters_grad.0"]["weight"][0]
    assert weight["Max"] == pytest.approx(float((model[0].weight.grad - first["0.weight"]).max()))
    gelu = data["Module.1.GELU.backward.0"]  # its input and output gradients both arrived: sealed, then written again
    assert gelu["input"][0]["shape"] == [2, 4] and gelu["output"][0]["shape"] == [2, 4]


def test_statistics_past_the_summarizers_memory_are_the_same(tmp_path, monkeypatch):
    """The summarizer remembers a bounded number of tensor versions: a version summarized again after it fell
    out gets the same record as when it is remembered."""
    from msprobe_core.pytorch import summarize

    def records(limit, sub):
        monkeypatch.setattr(summarize, "CACHE_SIZE", limit)
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
        return load(run_once(tmp_path / sub, model, {"level": "mix"}, inputs=torch.randn(2, 4)))["data"]

    assert records(1, "small") == records(1 << 20, "large")
