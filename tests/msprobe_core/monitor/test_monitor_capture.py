"""Evidence on alert (``on_anomaly.dump``): a fault is injected, the alert names the capture folder, and the
capture (the next step, scoped to the alerted module) opens with the compare reader. Plain ``TrainerMon`` on
the TinyGPT of ``benchmarks/alert_models.py``, two gloo ranks (each rank that alerted captures, one that did not
captures nothing) and the Hugging Face callback on the real Trainer. DeepSpeed's and the Megatron flags' are in
their integrations' tests."""

from __future__ import annotations

import csv
import json
import math
import sqlite3
import textwrap
from pathlib import Path

import pytest
import torch

from msprobe_core.dumpdir.rank_dump import load_rank_dump
from msprobe_core.errors import ConfigError, UnknownKeyError
from msprobe_core.monitor.config import CaptureConfig, load_monitor_config

CAPTURE = {"dump": {"task": "statistics", "level": "L1", "steps": 1, "max_captures": 3}}


def test_on_anomaly_defaults_and_bad_values_name_field_value_and_allowed():
    assert load_monitor_config({"on_anomaly": {"dump": {}}}).on_anomaly == CaptureConfig("statistics", "L1", 1, 3)
    assert load_monitor_config({}).on_anomaly is None
    assert load_monitor_config({"on_anomaly": {"dump": {"task": "nan_check", "level": "mix"}}}).on_anomaly.task == \
        "overflow_check"  # what the dump config accepts, aliases included
    for dump, field, allowed in [({"task": "acc_check"}, "on_anomaly.dump.task", "statistics, tensor"),
                                 ({"level": "L3"}, "on_anomaly.dump.level", "L0, L1, mix, debug"),
                                 ({"steps": 0}, "on_anomaly.dump.steps", "an int >= 1"),
                                 ({"max_captures": True}, "on_anomaly.dump.max_captures", "an int >= 1")]:
        with pytest.raises(ConfigError) as e:
            load_monitor_config({"on_anomaly": {"dump": dump}})
        assert e.value.field == field and allowed in e.value.allowed and e.value.value == next(iter(dump.values()))
    with pytest.raises(UnknownKeyError, match="on_anomaly.dump.task"):
        load_monitor_config({"on_anomaly": {"dump": {"tasks": "tensor"}}})


@pytest.fixture(scope="module")
def alert_models():
    import alert_models

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield alert_models
    torch.set_num_threads(threads)


def _tiny_run(alert_models, out: Path, capture: dict | None, fault_step: int = 9, steps: int = 13):
    from msprobe_core.pytorch import TrainerMon

    cfg = dict(alert_models.MONITOR_CONFIG, param_distribution=False,
               alert=dict(alert_models.MONITOR_CONFIG["alert"], dump=True,
                          inform={"recipient": "database", "connection_str": f"sqlite:///{out / 'alerts.db'}"}))
    if capture is not None:
        cfg["on_anomaly"] = capture
    w = alert_models.build("tiny_gpt")
    mon = TrainerMon(cfg, output_dir=out)
    mon.set_monitor(w.model, w.grad_acc, w.optimizer)
    losses = alert_models.run(w, steps, alert_models.Fault("weight_x50", fault_step))
    mon.close()
    return losses, [p.detach().clone() for p in w.model.parameters()], mon


def test_an_alert_captures_the_next_step_of_its_module_and_the_numbers_do_not_change(tmp_path, alert_models):
    l0, p0, plain = _tiny_run(alert_models, tmp_path / "plain", None)
    l1, p1, mon = _tiny_run(alert_models, tmp_path / "mon", CAPTURE)
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(p0, p1))  # bit-identical with the capture
    assert not (tmp_path / "plain" / "captures").exists() and plain.anomalies[0].capture is None

    alert = mon.anomalies[0]
    assert (alert.step, alert.module) == (9, "blocks.0.fc1")
    folder = Path(alert.capture)
    assert folder == tmp_path / "mon" / "captures" / "step9_blocks.0.fc1" / "step10" / "rank0"
    dump = load_rank_dump(folder)  # the compare reader
    assert (dump.task, dump.level, dump.framework) == ("statistics", "L1", "pytorch")
    # scoped to blocks.0.fc1: its one linear call, forward and backward, and nothing else of the model
    assert sorted(dump.data) == ["Functional.linear.0.backward", "Functional.linear.0.forward"]
    weight = dump.data["Functional.linear.0.forward"]["input_args"][1]
    assert weight["shape"] == [256, 64] and weight["Norm"] > 100  # the weight x50 (about 4.6 before)

    assert json.loads((tmp_path / "mon" / "rank0" / "anomalies.json").read_text())[0]["capture"] == str(folder)
    with open(tmp_path / "mon" / "rank0" / "anomalies.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))  # the same record for a spreadsheet
    assert (rows[0]["step"], rows[0]["module"], rows[0]["capture"]) == ("9", "blocks.0.fc1", str(folder))
    row = sqlite3.connect(str(tmp_path / "mon" / "alerts.db")).execute("SELECT step, capture FROM anomalies").fetchall()
    assert row == [(9, str(folder))]
    assert f"evidence: {folder}" in alert.describe()


def test_captures_stop_at_max_captures_and_cost_nothing_before_an_alert(tmp_path, alert_models):
    from msprobe_core.monitor.capture import AnomalyCapture
    from msprobe_core.monitor.anomaly import Anomaly

    cap = AnomalyCapture(CaptureConfig(max_captures=1), tmp_path, rank=3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    cap.between_steps([model], 5)  # nothing armed: nothing installed
    assert cap._service is None and not (tmp_path / "captures").exists()
    a = Anomaly(3, 4, None, "gradient", 0, "grad", "optimizer.param_groups.0.lr", "optimizer", "lr", 1.0, 0.1,
                "AnomalyTurbulence")
    assert cap.folder_for(a) == str(tmp_path / "captures" / "step4_model" / "step5" / "rank3")
    assert cap.folder_for(a) is None  # one at a time, and max_captures=1
    cap.between_steps([model], 5)
    model(torch.ones(2, 4)).sum().backward()
    cap.between_steps([model], 6)
    data = load_rank_dump(tmp_path / "captures" / "step4_model" / "step5" / "rank3").data
    assert "Functional.linear.0.forward" in data  # an LR alert names no module: the whole model
    assert cap.folder_for(a) is None and not cap.busy


@pytest.mark.slow
def test_the_hugging_face_callback_captures_on_alert(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the Trainer needs it (absent from make test-megatron-latest's venv)
    from transformers import Trainer, TrainerCallback

    from hf_support import TokenDataset, tiny_llama, training_args
    from msprobe_integrations.hf import MsprobeCallback

    class NanWeight(TrainerCallback):
        """A NaN in one weight before the third optimizer step."""

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                with torch.no_grad():
                    model.model.layers[1].mlp.up_proj.weight.view(-1)[5] = math.nan

    monitor = {"xy_distribution": True, "wg_distribution": True, "ops": ["min", "max", "norm", "nans"],
               "format": ["csv"], "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}}

    def train(out, cfg):
        cb = MsprobeCallback(monitor_config_path=cfg, monitor_output_dir=str(out / "mon"))
        trainer = Trainer(model=tiny_llama(), args=training_args(out / "hf", max_steps=4),
                          train_dataset=TokenDataset(), callbacks=[NanWeight(), cb])
        trainer.train()
        return [repr(h["loss"]) for h in trainer.state.log_history if "loss" in h], cb.session.monitor

    ref, _ = train(tmp_path / "ref", monitor)
    losses, mon = train(tmp_path / "cap", dict(monitor, on_anomaly={"dump": {}}))
    assert losses == ref  # NaN from step 3 on in both, the same numbers before
    alert = mon.anomalies[0]
    assert alert.step == 3 and alert.module == "model.layers.1.mlp.up_proj"
    folder = Path(alert.capture)
    assert folder == tmp_path / "cap" / "mon" / "captures" / "step3_model.layers.1.mlp.up_proj" / "step4" / "rank0"
    dump = load_rank_dump(folder)
    assert dump.data and all(name.startswith("Functional.linear.") for name in dump.data)
    weight = dump.data["Functional.linear.0.forward"]["input_args"][1]
    assert weight["shape"] == [128, 64] and math.isnan(weight["Norm"])


TWO_RANKS = textwrap.dedent("""
    import json, math, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from msprobe_core.pytorch import TrainerMon
    from msprobe_core.session import finish_distributed

    tmp = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    CONFIG = {"xy_distribution": True, "wg_distribution": True, "ops": ["min", "max", "norm", "nans"],
              "format": ["csv"], "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}}

    def train(name, ddp, capture):
        # a NaN put into the last layer's weight on rank 1 before step 2; with DDP the all-reduced
        # gradients carry it to rank 0, without it rank 0 stays healthy
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        net = DDP(model) if ddp else model
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        config = dict(CONFIG, on_anomaly={"dump": {}}) if capture else CONFIG
        mon = TrainerMon(config, output_dir=f"{tmp}/{name}")
        mon.set_monitor(net, 1, opt)
        g = torch.Generator().manual_seed(rank)
        losses = []
        for step in range(5):
            if step == 2 and rank == 1:
                with torch.no_grad():
                    model[2].weight.view(-1)[3] = math.nan
            opt.zero_grad()
            loss = net(torch.randn(8, 6, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss).hex())
        mon.close()
        weights = [float(p.detach().double().sum()).hex() for p in model.parameters()]
        alerts = [{"step": a.step, "module": a.module, "capture": a.capture} for a in mon.anomalies]
        del net
        return {"losses": losses, "weights": weights, "alerts": alerts}

    result = {f"{name}_{mode}": train(f"{name}_{mode}", name == "ddp", mode == "cap")
              for name in ("ddp", "local") for mode in ("ref", "cap")}
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    finish_distributed()
""")


@pytest.mark.slow
def test_every_rank_that_alerted_writes_its_capture_two_gloo_ranks(tmp_path):
    from dist_run import run_two_ranks

    run_two_ranks(TWO_RANKS, tmp_path, str(tmp_path), timeout=240, name="two_ranks.py")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(ranks):
        for name in ("ddp", "local"):
            ref, cap = result[f"{name}_ref"], result[f"{name}_cap"]
            assert cap["losses"] == ref["losses"] and cap["weights"] == ref["weights"], (rank, name)
            assert all(a["capture"] is None for a in ref["alerts"])
            assert not (tmp_path / f"{name}_ref" / "captures").exists()
            if name == "local" and rank == 0:  # this rank never alerted: it captures nothing
                assert cap["alerts"] == [] and not list((tmp_path / "local_cap").glob("captures/*/*/rank0"))
                continue
            first = cap["alerts"][0]
            folder = Path(first["capture"])
            label = first["module"] or "model"
            assert folder == (tmp_path / f"{name}_cap" / "captures" / f"step{first['step']}_{label}" /
                              f"step{first['step'] + 1}" / f"rank{rank}"), (rank, name)
            dump = load_rank_dump(folder)  # the compare reader
            assert dump.data and (dump.task, dump.level) == ("statistics", "L1")
            record = json.loads((tmp_path / f"{name}_cap" / f"rank{rank}" / "anomalies.json").read_text())[0]
            assert record["capture"] == str(folder)
    assert ranks[1]["local_cap"]["alerts"][0]["step"] == 2  # the faulty rank alerts at the fault's step
