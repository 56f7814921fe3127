"""End-to-end tests of the training monitor with real torch on small CPU models.

Expected statistics are computed here independently (float64 torch reductions on the same tensors);
TensorBoard files are read back with tensorboard's own ``EventAccumulator``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from msprobe_core.errors import ConfigError
from msprobe_core.monitor.anomaly import order_key
from msprobe_core.monitor.state_readers import TorchStateReader
from msprobe_core.monitor.trainer_mon import TrainerMon

ALL_OPS = ["min", "max", "norm", "mean", "zeros", "nans"]
EVERYTHING = {"xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": True}
TURBULENCE = {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True}


class Net(nn.Module):
    def __init__(self, inplace: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 32)
        self.relu = nn.ReLU(inplace=inplace)
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.relu(self.fc2(self.act(self.fc1(x))))))


def make(seed: int = 0, opt: str = "adamw", inplace: bool = False):
    torch.manual_seed(seed)
    model = Net(inplace)
    if opt == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif opt == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return model, optimizer


def batches(n: int, seed: int = 1, size: int = 64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 1, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(size, 8, generator=g)
        out.append((x, x @ w + 0.1 * torch.randn(size, 1, generator=g)))
    return out


def train(model, optimizer, data, grad_acc: int = 1, inject=None):
    """Plain loop: zero_grad, grad_acc micro-batches, step. Returns losses."""
    losses = []
    for step, (x, y) in enumerate(data):
        if inject:
            inject(step, model)
        optimizer.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(grad_acc), y.chunk(grad_acc)):
            loss = F.mse_loss(model(xs), ys) / grad_acc
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
    return losses


def write_config(path: Path, **cfg) -> str:
    path.write_text(json.dumps(cfg))
    return str(path)


def expected(t: torch.Tensor, eps: float = 1e-8) -> dict[str, float]:
    t = t.detach().to(torch.float64)
    return {"min": t.min().item(), "max": t.max().item(), "norm": torch.sqrt((t * t).sum()).item(),
            "mean": t.mean().item(), "zeros": (t.abs() <= eps).to(torch.float64).mean().item(),
            "nans": float(torch.isnan(t).sum().item())}


def close(a: float, b: float, rel: float = 2e-5, abs_: float = 1e-7) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


# ---------------------------------------------------------------------------------------------- outputs
def test_tensorboard_values_match_independent_computation(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = write_config(tmp_path / "c.json", **EVERYTHING, ops=ALL_OPS, format="tensorboard")
    model, opt = make()
    mon = TrainerMon(cfg, output_dir=tmp_path / "out")
    mon.set_monitor(model, 1, opt)
    want: dict[str, list[dict[str, float]]] = {}

    def keep(tag_base: str, t: torch.Tensor) -> None:
        want.setdefault(tag_base, []).append(expected(t))

    for x, y in batches(3):
        with torch.no_grad():  # the forward, redone functionally (no module call, so no monitor hook)
            h1 = F.linear(x, model.fc1.weight, model.fc1.bias)
            keep("fc1.output/actv", h1)
            keep("fc2.output/actv", F.linear(F.gelu(h1), model.fc2.weight, model.fc2.bias))
        opt.zero_grad()
        out = model(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        keep("head.output/actv_grad", 2 * (out.detach() - y) / y.numel())
        for name in ("fc1.weight", "head.bias", "ln.weight"):
            p = dict(model.named_parameters())[name]
            keep(f"{name}/grad", p.grad)
            keep(f"{name}/param", p)
        opt.step()
        for name in ("fc1.weight", "ln.bias"):
            p = dict(model.named_parameters())[name]
            keep(f"{name}/exp_avg", opt.state[p]["exp_avg"])
            keep(f"{name}/exp_avg_sq", opt.state[p]["exp_avg_sq"])
    mon.close()

    acc = EventAccumulator(str(tmp_path / "out" / "rank0"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    checked = 0
    for base, per_step in want.items():
        for op in ALL_OPS:
            events = acc.Scalars(f"{base}_{op}")
            assert [e.step for e in events] == [0, 1, 2], base
            for e, exp in zip(events, per_step):
                assert close(e.value, exp[op]), (base, op, e.step, e.value, exp[op])
                checked += 1
    assert checked == len(want) * 3 * len(ALL_OPS)
    # every kind is there and tags can be filtered by kind and op
    for kind in ("actv", "actv_grad", "grad", "exp_avg", "exp_avg_sq", "param"):
        assert any(t.endswith(f"/{kind}_norm") for t in tags), kind
    assert "fc1.input/actv_norm" in tags and "fc1.input/actv_grad_norm" not in tags  # x needs no grad


def test_csv_files_roll_over_and_read_back(tmp_path):
    cfg = write_config(tmp_path / "c.json", xy_distribution=True, wg_distribution=True, ops=["norm", "max"],
                       format="csv", step_count_per_record=2, ndigits=8)
    model, opt = make()
    mon = TrainerMon(cfg, output_dir=tmp_path / "out")
    mon.set_monitor(model, 1, opt)
    grads: list[dict[str, float]] = []
    for x, y in batches(4):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads.append(expected(model.fc2.weight.grad))
        opt.step()
    mon.close()
    rank = tmp_path / "out" / "rank0"
    assert sorted(p.name for p in rank.glob("grad_*.csv")) == ["grad_0-1.csv", "grad_2-3.csv"]
    rows = []
    for name in ("grad_0-1.csv", "grad_2-3.csv"):
        with open(rank / name, newline="") as f:
            reader = csv.reader(f)
            assert next(reader) == ["name", "step", "norm", "max"]
            rows += [r for r in reader if r[0] == "fc2.weight"]
    assert [int(r[1]) for r in rows] == [0, 1, 2, 3]
    for r, exp in zip(rows, grads):
        assert close(float(r[2]), exp["norm"], 1e-6) and close(float(r[3]), exp["max"], 1e-6)
    with open(rank / "actv_0-1.csv", newline="") as f:
        reader = csv.reader(f)
        assert next(reader) == ["name", "step", "micro_step", "norm", "max"]
        names = {r[0] for r in reader}
    assert {"fc1.output", "fc2.input", "head.output"} <= names


def test_api_format_returns_latest_metrics(tmp_path):
    cfg = write_config(tmp_path / "c.json", wg_distribution=True, mv_distribution=True, ops=["norm"], format="api")
    model, opt = make()
    mon = TrainerMon(cfg, output_dir=tmp_path / "out")
    mon.set_monitor(model, 1, opt, patch_optimizer=False)
    x, y = batches(1)[0]
    F.mse_loss(model(x), y).backward()
    norm = model.head.weight.grad.norm().item()
    opt.step()
    result = mon.step()
    assert result is mon.get_metrics() and result["step"] == 0
    assert close(result["metrics"]["grad"]["head.weight"]["norm"], norm)
    assert set(result["metrics"]) == {"grad", "exp_avg", "exp_avg_sq"}
    assert not (tmp_path / "out" / "rank0").exists() or not list((tmp_path / "out" / "rank0").glob("*.csv"))
    mon.close()


# ------------------------------------------------------------------------------------------ trust
def test_losses_and_gradients_bit_identical_with_monitor(tmp_path):
    data = batches(4)

    def run(monitored: bool):
        model, opt = make(inplace=True)
        mon = None
        if monitored:
            cfg = write_config(tmp_path / "c.json", **EVERYTHING, ops=ALL_OPS, format=["csv", "tensorboard", "api"],
                               alert=TURBULENCE)
            mon = TrainerMon(cfg, output_dir=tmp_path / "out")
            mon.set_monitor(model, 2, opt)
        grads = []

        def inject(step, m):
            if step:
                grads.append([p.grad.clone() for p in m.parameters()])

        losses = train(model, opt, data, grad_acc=2, inject=inject)
        grads.append([p.grad.clone() for p in model.parameters()])
        if mon:
            assert len(mon.get_metrics()["metrics"]["actv"]) > 0
            mon.close()
        return losses, grads, [p.detach().clone() for p in model.parameters()]

    l0, g0, p0 = run(False)
    l1, g1, p1 = run(True)
    assert l0 == l1
    assert all(torch.equal(a, b) for ga, gb in zip(g0, g1) for a, b in zip(ga, gb))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def test_close_removes_every_hook_and_restores_step(tmp_path):
    cfg = write_config(tmp_path / "c.json", **EVERYTHING, format="csv")
    model, opt = make()
    original_step = opt.step

    def hook_counts():
        return [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]

    before = hook_counts()
    mon = TrainerMon(cfg, output_dir=tmp_path / "out")
    mon.set_monitor(model, 1, opt)
    assert hook_counts() != before and "step" in opt.__dict__
    train(model, opt, batches(2))
    mon.close()
    assert hook_counts() == before
    assert "step" not in opt.__dict__ and opt.step == original_step
    mon.close()  # idempotent


def test_missing_gradients_are_not_nans(tmp_path):
    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)

        def forward(self, x, mask=None):
            return self.used(self.frozen(x))

    cfg = write_config(tmp_path / "c.json", **EVERYTHING, ops=ALL_OPS, format="api",
                       alert={"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5, "warmup": 1}}]})
    torch.manual_seed(0)
    model = Partly()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    mon = TrainerMon(cfg, output_dir=tmp_path / "out")
    mon.set_monitor(model, 1, opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(16, 4, generator=g), mask=torch.ones(16, dtype=torch.bool)).pow(2).mean().backward()
        opt.step()
    metrics = mon.get_metrics()["metrics"]
    mon.close()
    assert set(metrics["grad"]) == {"used.weight", "used.bias"}
    assert "frozen.weight" not in metrics["param"]
    assert "frozen.input" in metrics["actv"] and "frozen.input" not in metrics["actv_grad"]
    assert all(v["nans"] == 0 for kind in metrics.values() for v in kind.values())
    assert mon.anomalies == []


def test_healthy_run_is_quiet_and_injected_spike_and_nan_are_caught(tmp_path, caplog):
    cfg = write_config(tmp_path / "c.json", **EVERYTHING, ops=ALL_OPS, format="csv", alert=TURBULENCE)
    data = batches(30)

    model, opt = make()
    mon = TrainerMon(cfg, output_dir=tmp_path / "healthy")
    mon.set_monitor(model, 1, opt)
    train(model, opt, data)
    mon.close()
    assert mon.anomalies == []

    def inject(step, m):
        with torch.no_grad():
            if step == 20:
                m.fc2.weight.mul_(50)
            if step == 25:
                m.fc1.weight[3, 2] = float("nan")

    model, opt = make()
    mon = TrainerMon(cfg, output_dir=tmp_path / "sick")
    seen = []
    mon.register_anomaly_callback(seen.append)
    mon.set_monitor(model, 1, opt)
    with caplog.at_level("WARNING", logger="msprobe_core.monitor"):
        train(model, opt, data, inject=inject)
    mon.close()
    found = mon.anomalies
    assert found and seen == found
    assert min(a.step for a in found) == 20
    first20 = min((a for a in found if a.step == 20), key=order_key)
    assert (first20.module, first20.name, first20.rule) == ("fc2", "fc2.weight", "AnomalyTurbulence")
    assert first20.value / first20.baseline > 40
    assert {a.module for a in found if a.step == 20} <= {"fc2", "relu", "ln", "head"}
    assert not [a for a in found if 20 < a.step < 25]  # a lasting shift is reported once
    first25 = min((a for a in found if a.step == 25), key=order_key)
    assert (first25.module, first25.name, first25.rule, first25.metric, first25.value) == \
        ("fc1", "fc1.weight", "AnomalyNan", "nans", 1.0)
    lines = [r for r in caplog.records if "anomaly rank 0 step" in r.getMessage()]
    assert 0 < len(lines) <= 10 * len({a.step for a in found})

    # the dump and the command line name the same first anomalies
    files = list((tmp_path / "sick").rglob("anomalies.json"))
    assert len(files) == 1 and len(json.loads(files[0].read_text())) == len(found)
    out = subprocess.run([sys.executable, "-m", "msprobe_core", "anomalies", str(tmp_path / "sick"), "-s", "25"],
                         capture_output=True, text=True, check=True).stdout
    assert "first anomaly: step 25, rank 0, param, param 'fc1.weight' in module 'fc1'" in out


# ------------------------------------------------------------------------------ integration points
def test_explicit_entry_points_record_gradients_before_clipping(tmp_path):
    cfg = write_config(tmp_path / "c.json", wg_distribution=True, ops=["norm"], format="api")
    model, opt = make(opt="sgd")
    mon = TrainerMon(cfg, output_dir=tmp_path / "out")
    mon.set_monitor(model, 1, opt, patch_optimizer=False)
    assert "step" not in opt.__dict__
    for step, (x, y) in enumerate(batches(2)):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        before = model.fc1.weight.grad.norm().item()
        mon.collect_grads()  # the integration's pre-clip hook point
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-4)
        opt.step()
        result = mon.step(optimizer_step=10 + step)
        assert result["step"] == 10 + step
        assert close(result["metrics"]["grad"]["fc1.weight"]["norm"], before)
    assert mon.step_index == 12
    mon.close()


def test_sgd_momentum_is_first_moment_and_main_grad_is_read(tmp_path):
    cfg = write_config(tmp_path / "c.json", wg_distribution=True, mv_distribution=True, ops=["norm"], format="api")
    model, opt = make(opt="sgd")
    mon = TrainerMon(cfg, output_dir=tmp_path / "out")
    mon.set_monitor(model, 1, opt)
    train(model, opt, batches(2))
    metrics = mon.get_metrics()["metrics"]
    mom = opt.state[model.fc1.weight]["momentum_buffer"]
    assert close(metrics["exp_avg"]["fc1.weight"]["norm"], mom.norm().item())
    assert "exp_avg_sq" not in metrics
    mon.close()

    p = nn.Parameter(torch.ones(3))
    p.grad = torch.zeros(3)
    p.main_grad = torch.full((3,), 2.0)
    assert TorchStateReader(True).grads({"p": p})["p"] is p.main_grad
    assert TorchStateReader(False).grads({"p": p})["p"] is p.grad


def test_model_chunks_gradient_accumulation_and_targets(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = write_config(tmp_path / "c.json", xy_distribution=True, wg_distribution=True, ops=["norm"],
                       format=["tensorboard", "api"], targets={"0:fc2": {}, "1:body": {"output": "tensor"}})
    torch.manual_seed(0)
    first, second = make()[0], nn.Sequential()
    second.add_module("body", nn.Linear(1, 1))
    opt = torch.optim.Adam([*first.parameters(), *second.parameters()], lr=1e-3)
    mon = TrainerMon(cfg, output_dir=tmp_path / "out")
    mon.set_monitor([first, second], 2, opt)
    for x, y in batches(2):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            F.mse_loss(second(first(xs)), ys).backward()
        opt.step()
    metrics = mon.get_metrics()["metrics"]
    mon.close()
    assert set(metrics["actv"]) == {"0:fc2.input:0", "0:fc2.output:0", "0:fc2.input:1", "0:fc2.output:1",
                                    "1:body.output:0", "1:body.output:1"}
    assert set(metrics["grad"]) == {"0:fc2.weight", "0:fc2.bias", "1:body.weight", "1:body.bias"}
    acc = EventAccumulator(str(tmp_path / "out" / "rank0"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("0:fc2.output:1/actv_norm")] == [0, 1]


def test_schedule_start_interval_collect_times(tmp_path):
    cfg = write_config(tmp_path / "c.json", wg_distribution=True, ops=["norm"], format="csv",
                       start_step=1, step_interval=2, collect_times=2, step_count_per_record=10)
    model, opt = make()
    mon = TrainerMon(cfg, output_dir=tmp_path / "out")
    mon.set_monitor(model, 1, opt)
    train(model, opt, batches(8))
    mon.close()
    with open(tmp_path / "out" / "rank0" / "grad_1-19.csv", newline="") as f:
        steps = sorted({int(r["step"]) for r in csv.DictReader(f)})
    assert steps == [1, 3]


def test_dynamic_on_switches_collection_without_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    path = tmp_path / "c.json"
    write_config(path, xy_distribution=True, wg_distribution=True, ops=["norm"], format="api", dynamic_on=False)
    model, opt = make()
    mon = TrainerMon(str(path), output_dir=tmp_path / "out")
    mon.set_monitor(model, 1, opt)
    data = batches(6)
    train(model, opt, data[:2])
    assert mon.get_metrics() == {} and not mon.collecting
    hooks_off = sum(len(m._forward_hooks) for m in model.modules())
    write_config(path, xy_distribution=True, wg_distribution=True, ops=["norm"], format="api", dynamic_on=True,
                 collect_times=2)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    steps = []
    for x, y in data[2:]:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        steps.append(mon.get_metrics().get("step"))
    # the config is polled when a step ends: the edit is seen at the end of step 2, so steps 3 and 4 are
    # collected (collect_times 2) and collection stops again
    assert steps == [None, 3, 4, 4]
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_off
    mon.close()


def test_print_struct_and_checkpointed_model(tmp_path):
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Net()

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    data = batches(2)

    def run(monitored):
        torch.manual_seed(0)
        model = Ckpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = None
        if monitored:
            cfg = write_config(tmp_path / "c.json", **EVERYTHING, ops=["norm"], format="api", print_struct=True)
            mon = TrainerMon(cfg, output_dir=tmp_path / "out")
            mon.set_monitor(model, 1, opt)
        losses = train(model, opt, data)
        metrics = mon.get_metrics()["metrics"] if mon else None
        if mon:
            mon.close()
        return losses, [p.detach().clone() for p in model.parameters()], metrics

    l0, p0, _ = run(False)
    l1, p1, metrics = run(True)
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert "inner.fc1.output" in metrics["actv"] and not any(".call1" in n for n in metrics["actv"])
    assert "inner.fc1.output" in metrics["actv_grad"]
    struct = json.loads((tmp_path / "out" / "rank0" / "module_struct.json").read_text())
    assert struct["inner.fc1"] == {"class": "Linear", "params": {"weight": [32, 8], "bias": [32]}}


def test_invalid_arguments_raise_config_errors(tmp_path):
    cfg = write_config(tmp_path / "c.json", wg_distribution=True)
    model, opt = make()
    mon = TrainerMon(cfg, output_dir=tmp_path / "out")
    with pytest.raises(ConfigError, match="grad_acc_steps"):
        mon.set_monitor(model, 0, opt)
    with pytest.raises(ConfigError, match="start_iteration"):
        mon.set_monitor(model, 1, opt, start_iteration=-1)
    mon.set_monitor(model, opt, 1)  # msprobe's older (model, optimizer, grad_acc_steps) order
    assert mon.grad_acc_steps == 1 and "step" in opt.__dict__
    mon.close()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"ops": ["norm", "p99"]}))
    with pytest.raises(ValueError, match="'ops'.*'p99'.*min, max, norm, mean, zeros, nans"):
        TrainerMon(str(bad))


def test_importable_and_usable_without_tensorboardx(tmp_path):
    cfg = write_config(tmp_path / "c.json", wg_distribution=True, ops=["norm"], format="csv")
    code = (
        "import sys; sys.modules['tensorboardX'] = None\n"
        "import torch\n"
        "from msprobe_core.monitor.trainer_mon import TrainerMon\n"
        "m = torch.nn.Linear(2, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        f"mon = TrainerMon({cfg!r}, output_dir={str(tmp_path / 'out')!r}); mon.set_monitor(m, 1, o)\n"
        "m(torch.ones(1, 2)).sum().backward(); o.step(); mon.close()\n"
        "assert 'tensorboardX' not in sys.modules or sys.modules['tensorboardX'] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])
    assert (tmp_path / "out" / "rank0" / "grad_0-0.csv").exists()


def test_record_custom_kind_and_unregister_callback(tmp_path):
    cfg = write_config(tmp_path / "c.json", ops=["norm", "nans"], format=["csv", "api"])
    model, opt = make()
    mon = TrainerMon(cfg, output_dir=tmp_path / "out")
    seen = []
    unregister = mon.register_anomaly_callback(seen.append)  # turns NaN checks on without an alert section
    mon.set_monitor(model, 1, opt, patch_optimizer=False)
    assert mon.collecting
    mon.record("grad_unreduced", {"fc1.weight": torch.full((2, 2), 3.0)}, micro_step=0)
    mon.record("grad_unreduced", {"fc1.weight": torch.tensor([1.0, float("nan")])}, micro_step=1)
    result = mon.step()
    assert result["metrics"]["grad_unreduced"]["fc1.weight"] == {"norm": pytest.approx(6.0), "nans": 0.0}
    assert result["metrics"]["grad_unreduced"]["fc1.weight:1"]["nans"] == 1.0
    assert [(a.kind, a.micro_step, a.rule) for a in seen] == [("grad_unreduced", 1, "AnomalyNan")]
    unregister()
    mon.record("grad_unreduced", {"other": torch.tensor([float("nan")])})
    mon.step()
    assert len(seen) == 1 and len(mon.anomalies) == 2
    mon.close()
    with open(tmp_path / "out" / "rank0" / "grad_unreduced_0-0.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["name", "step", "micro_step", "norm", "nans"]
    assert [r[:3] for r in rows[1:]] == [["fc1.weight", "0", "0"], ["fc1.weight", "0", "1"]]
