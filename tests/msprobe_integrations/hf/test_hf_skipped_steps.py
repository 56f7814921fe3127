"""An update the Trainer's loss scaler skips is a skipped step, not NaN/Inf anomalies (the real Trainer and
Accelerate, tiny Llama, CPU).

Accelerate makes no GradScaler on the CPU (fp16 mixed precision needs an accelerator), so the test gives the
Trainer's Accelerator a real ``torch.amp.GradScaler("cpu")`` before training: the loss is scaled, the
optimizer is Accelerate's ``AcceleratedOptimizer`` with that scaler, exactly as with ``fp16=True`` on a GPU.
At the second step one gradient overflows in the backward pass: the scaler skips the update and halves its
scale. (The Trainer's default optimizer is fused AdamW, which the scaler steps every time, skipping
inside: Accelerate's ``step_was_skipped`` says False there; the scale says it.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback  # noqa: E402

from hf_support import TokenDataset, tiny_llama, training_args  # noqa: E402
from msprobe_integrations.hf import MsprobeCallback  # noqa: E402

MONITOR = {"targets": {}, "wg_distribution": True, "ops": ["min", "max", "norm", "nans"], "format": ["api"],
           "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]}}


class Overflow(TrainerCallback):
    """An Inf in one gradient of the second optimizer step, made in the backward pass."""

    def __init__(self):
        self.scales: list[float] = []
        self.step = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.model.layers[1].mlp.up_proj.weight.register_hook(self._overflow)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1

    def _overflow(self, grad):
        if self.step != 2:
            return None
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.scales.append(optimizer.scaler.get_scale())


@pytest.mark.slow
def test_a_step_the_grad_scaler_skipped_is_reported_as_skipped(tmp_path):
    overflow = Overflow()
    cb = MsprobeCallback(monitor_config_path=MONITOR, monitor_output_dir=str(tmp_path / "mon"))
    trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path / "hf", max_steps=3, max_grad_norm=0.0),
                      train_dataset=TokenDataset(), callbacks=[overflow, cb])
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    trainer.train()
    assert overflow.scales == [65536.0, 32768.0, 32768.0]   # the scaler backed off once: one skipped update
    monitor = cb.session.monitor
    assert [s.step for s in monitor.skipped_steps] == [2]
    assert monitor.skipped_steps[0].origin == "model.layers.1.mlp.up_proj.weight"
    assert monitor.anomalies == []
