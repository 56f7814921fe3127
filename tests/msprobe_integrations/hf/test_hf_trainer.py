"""The Hugging Face Trainer callback against the real transformers Trainer (tiny Llama, CPU)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Trainer  # noqa: E402

from dist_run import run_two_ranks  # noqa: E402
from hf_support import TokenDataset, tiny_llama, training_args  # noqa: E402
from msprobe_integrations.hf import MsprobeCallback  # noqa: E402


MONITOR = {"targets": {}, "xy_distribution": True, "wg_distribution": True, "mv_distribution": True,
           "param_distribution": True, "ops": ["min", "max", "norm", "mean", "nans"], "format": ["tensorboard", "csv", "api"],
           "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True}}


def train(tmp_path, callbacks, **kw):
    trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path / "hf", **kw), train_dataset=TokenDataset(),
                      callbacks=callbacks)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    grads = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer, losses, grads


@pytest.mark.slow
def test_losses_bit_identical_and_dump_per_optimizer_step(tmp_path):
    _, ref_losses, ref_weights = train(tmp_path / "ref", [], gradient_accumulation_steps=2, max_grad_norm=1.0)
    dump = tmp_path / "dump"
    cb = MsprobeCallback(config_path={"task": "statistics", "level": "mix", "dump_path": str(dump)},
                         monitor_config_path=MONITOR, monitor_output_dir=str(tmp_path / "mon"))
    trainer, losses, weights = train(tmp_path / "tool", [cb], gradient_accumulation_steps=2, max_grad_norm=1.0)
    assert losses == ref_losses
    assert all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights)
    steps = sorted(p.name for p in dump.iterdir() if p.is_dir())
    assert steps == ["step1", "step2", "step3", "step4"]  # the Trainer's global steps
    rank_dir = next((dump / "step2").iterdir())
    data = json.loads((rank_dir / "dump.json").read_text())["data"]
    layer = "Module.model.layers.0.mlp.down_proj.Linear"
    assert f"{layer}.forward.0" in data and f"{layer}.forward.1" in data  # both micro-batches
    assert f"{layer}.forward.2" not in data
    assert f"{layer}.backward.1" in data and f"{layer}.parameters_grad.1" in data
    hp = json.loads((dump / "hyperparameters.json").read_text())
    assert hp["normalized"]["learning_rate"] == 1e-3 and hp["normalized"]["gradient_accumulation_steps"] == 2
    assert hp["normalized"]["micro_batch_size"] == 4 and hp["normalized"]["num_layers"] == 2
    assert hp["training_args"]["max_steps"] == 4 and hp["model_config"]["hidden_size"] == 64
    assert hp["optimizer"]["class"].endswith("AdamW") and "scheduler" in hp
    assert hp["versions"]["transformers"]
    assert (tmp_path / "mon" / "hyperparameters.json").exists()


@pytest.mark.slow
def test_monitor_tensorboard_steps_are_optimizer_steps_and_grads_before_clipping(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen = {}
    from transformers import TrainerCallback

    class GradSpy(TrainerCallback):
        """Independent computation of the unclipped gradient norm of one weight at the last micro-batch."""
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen.setdefault("clipped", []).append(model.model.layers[0].mlp.down_proj.weight.grad.norm().item())

    mon = tmp_path / "mon"
    cb = MsprobeCallback(monitor_config_path=MONITOR, monitor_output_dir=str(mon))
    trainer, losses, _ = train(tmp_path / "t", [cb, GradSpy()], gradient_accumulation_steps=2, max_grad_norm=1e-3)
    ea = EventAccumulator(str(mon / "rank0"))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    tag = "model.layers.0.mlp.down_proj.weight/grad_norm"
    events = ea.Scalars(tag)
    assert [e.step for e in events] == [1, 2, 3, 4]
    # reported before clipping: far above the clipped norm (max_grad_norm=1e-3 clips hard)
    assert all(e.value > 10 * c for e, c in zip(events, seen["clipped"]))
    assert any("/actv_" in t for t in tags) and any("/exp_avg_sq_" in t for t in tags)
    csvs = list((mon / "rank0").rglob("*.csv"))
    assert csvs
    hp = EventAccumulator(str(mon / "hparams"))
    hp.Reload()
    text = hp.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"learning_rate": 0.001' in text and "gradient_accumulation_steps" in text


@pytest.mark.slow
def test_stop_on_nan_stops_after_the_bad_step(tmp_path):
    from transformers import TrainerCallback

    class Poison(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:  # the third optimizer step gets a NaN weight
                with torch.no_grad():
                    model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")

    cb = MsprobeCallback(monitor_config_path=dict(MONITOR, format="api"), monitor_output_dir=str(tmp_path / "mon"),
                         stop_on_nan=True)
    trainer, losses, _ = train(tmp_path / "t", [Poison(), cb], max_steps=8)
    assert trainer.state.global_step == 3
    assert any("msprobe/stopped_on_nan" in h for h in trainer.state.log_history)
    assert any("msprobe/anomalies" in h for h in trainer.state.log_history)
    first = next(h["msprobe/first_anomaly"] for h in trainer.state.log_history if "msprobe/first_anomaly" in h)
    assert "step 3" in first and "layers.1.mlp.up_proj" in first


TWO_PROC = textwrap.dedent("""
    from transformers import Trainer
    from msprobe_core.session import finish_distributed
    from hf_support import TokenDataset, tiny_llama, training_args
    from msprobe_integrations.hf import MsprobeCallback
    cb = MsprobeCallback(config_path={{"level": "L0", "dump_path": {dump!r}}},
                         monitor_config_path={{"wg_distribution": True, "format": "csv", "ops": ["norm"]}},
                         monitor_output_dir={mon!r})
    args = training_args({out!r}, max_steps=2, use_cpu=True, ddp_backend="gloo")
    Trainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(), callbacks=[cb]).train()
    finish_distributed()  # everything is on disk: the callback closed the session at on_train_end
""")


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_torchrun(tmp_path):
    dump, mon = tmp_path / "dump", tmp_path / "mon"
    run_two_ranks(TWO_PROC.format(dump=str(dump), mon=str(mon), out=str(tmp_path / "o")), tmp_path, timeout=600)
    assert sorted(p.name for p in (dump / "step1").iterdir()) == ["rank0", "rank1"]
    assert sorted(p.name for p in mon.iterdir() if p.is_dir()) == ["rank0", "rank1"]
    assert (dump / "hyperparameters.json").exists() and (mon / "hyperparameters.json").exists()
    assert json.loads((dump / "hyperparameters.json").read_text())["normalized"]["world_size"] == 2


@pytest.mark.slow
def test_trl_sft_trainer_subclass(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    rows = TokenDataset(n=32)
    ds = Dataset.from_dict({"input_ids": [r.tolist() for r in rows.ids]})
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=2, per_device_train_batch_size=4, logging_steps=1,
                         save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                         dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)
    dump = tmp_path / "dump"
    cb = MsprobeCallback(config_path={"level": "L0", "dump_path": str(dump)},
                         monitor_config_path={"wg_distribution": True, "format": "api", "ops": ["norm"]},
                         monitor_output_dir=str(tmp_path / "mon"))

    def collate(batch):
        ids = torch.tensor([b["input_ids"] for b in batch])
        return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = Tokenizer(models.WordLevel({f"t{i}": i for i in range(1000)}, unk_token="t0"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab, unk_token="t0", pad_token="t1", eos_token="t2")
    trainer = trl.SFTTrainer(model=tiny_llama(), args=args, train_dataset=ds, data_collator=collate, callbacks=[cb],
                             processing_class=tokenizer)
    trainer.train()
    assert sorted(p.name for p in dump.iterdir() if p.is_dir()) == ["step1", "step2"]
    assert json.loads((dump / "hyperparameters.json").read_text())["training_args"]["max_steps"] == 2
    assert cb.session.monitor.get_metrics() == {} or cb.session.monitor.get_metrics()["step"] == 2


@pytest.mark.slow
def test_config_check_pack_from_the_callback(tmp_path):
    """``config_check_path`` makes the callback write msprobe's config_check pack; two runs that differ only in
    learning rate differ only in the hyperparameters check, and the losses are those of a run without the tool."""
    from msprobe_core.cli import main

    _, ref_losses, _ = train(tmp_path / "ref", [])
    packs = {}
    for name, lr in (("a", 1e-3), ("b", 2e-3)):
        packs[name] = tmp_path / f"{name}.zip"
        _, losses, _ = train(tmp_path / name, [MsprobeCallback(config_check_path=str(packs[name]))], learning_rate=lr)
        if name == "a":
            assert losses == ref_losses
        assert packs[name].is_file()
    out = tmp_path / "result"
    assert main(["config_check", "-c", str(packs["a"]), str(packs["b"]), "-o", str(out)]) == 1
    import openpyxl

    sheets = openpyxl.load_workbook(out / "result.xlsx")
    checks = ("env", "pip", "hyperparameters", "weights", "dataset", "random")
    summary = {row[0]: row[1] for row in sheets["summary"].iter_rows(min_row=2, values_only=True) if row[0] in checks}
    assert {check for check, result in summary.items() if result == "fail"} == {"hyperparameters"}, summary
    assert set(summary) == set(checks)
