"""The shared hyperparameter capture: alias normalisation, optimizer/scheduler sections, atomic file."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from msprobe_core import hparams


def test_aliases_normalise_framework_names(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    megatron_args = vars(SimpleNamespace(lr=1e-3, micro_batch_size=2, num_layers=4, hidden_size=64, train_iters=9,
                                         clip_grad=1.0, tensor_model_parallel_size=1, seed=3))
    doc = hparams.capture("megatron", {"args": megatron_args, "model_config": {"vocab_size": 100}}, opt, sched)
    n = doc["normalized"]
    assert (n["learning_rate"], n["micro_batch_size"], n["num_layers"], n["max_steps"], n["max_grad_norm"]) == (1e-3, 2, 4, 9, 1.0)
    assert doc["origin"]["learning_rate"] == "args.lr" and n["vocab_size"] == 100
    assert (n["adam_beta1"], n["adam_beta2"], n["adam_epsilon"], n["weight_decay"]) == (0.9, 0.95, 1e-6, 0.1)
    assert doc["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert doc["optimizer"]["param_groups"][0]["numel"] == 10
    assert doc["scheduler"]["class"].endswith("StepLR")
    assert doc["args"]["lr"] == 1e-3 and doc["versions"]["torch"] == torch.__version__
    path = hparams.write(tmp_path, doc)
    assert json.loads(path.read_text())["normalized"]["learning_rate"] == 1e-3
    assert not list(tmp_path.glob(".*tmp"))


def test_hf_and_deepspeed_names():
    doc = hparams.capture("deepspeed", {"ds_config": {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
                                                     "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}},
                          extra_normalized={"zero_stage": 2})
    assert doc["normalized"]["micro_batch_size"] == 8 and doc["normalized"]["zero_stage"] == 2
    doc = hparams.capture("transformers", {"training_args": {"per_device_train_batch_size": 4, "learning_rate": 5e-5,
                                                             "lr_scheduler_type": "linear"}})
    assert doc["normalized"]["micro_batch_size"] == 4 and doc["normalized"]["lr_scheduler"] == "linear"
    assert hparams.flat_for_tensorboard(doc)["learning_rate"] == 5e-5


def test_megatron_query_groups_count_only_with_grouped_query_attention():
    def heads(**args):
        doc = hparams.capture("megatron", {"args": {"num_attention_heads": 8, "num_query_groups": 1, **args}})
        return doc["normalized"]["num_key_value_heads"], doc["origin"]["num_key_value_heads"]

    assert heads(group_query_attention=False) == (8, "args.num_attention_heads")
    assert heads(group_query_attention=True, num_query_groups=2) == (2, "args.num_query_groups")
    hf = hparams.capture("transformers", {"model_config": {"num_attention_heads": 8, "num_key_value_heads": 2}})
    assert hf["normalized"]["num_key_value_heads"] == 2
