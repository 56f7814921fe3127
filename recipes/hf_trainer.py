"""Recipe: a Hugging Face Trainer run with dump, monitor, alerts and hyperparameter capture, in one line.

A small Llama built from a config (no hub download) trains on synthetic tokens on CPU, with
``MsprobeCallback`` dumping mix-level statistics of every optimizer step, monitoring activations,
gradients, weights and Adam moments into TensorBoard and CSV, and raising alerts. At the end it prints
where everything is. Copy the ``callbacks=[...]`` line into your own Trainer.

    python recipes/hf_trainer.py [--output-dir demo_output] [--steps 6] [--nan-at-step 0]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

DUMP_CONFIG = {
    "task": "statistics",
    "level": "mix",
    "step": [],
    "rank": [],
    "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"},
}
MONITOR_CONFIG = {
    "targets": {},
    "xy_distribution": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ops": ["min", "max", "norm", "mean", "zeros", "nans"],
    "format": ["tensorboard", "csv"],
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True},
}


class SyntheticTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, seq: int = 32, vocab: int = 1000, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-dir", default="demo_output", help="parent folder; each run gets its own subfolder")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps")
    ap.add_argument("--grad-acc", type=int, default=2, help="gradient accumulation steps")
    ap.add_argument("--nan-at-step", type=int, default=0,
                    help="inject a NaN weight before this global step to see an alert and stop_on_nan (0: no)")
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from msprobe_integrations.hf import MsprobeCallback

    run = Path(args.output_dir) / time.strftime("run-%Y%m%d-%H%M%S")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    callbacks: list = [MsprobeCallback(config_path=dict(DUMP_CONFIG, dump_path=str(run / "dump")),
                                       monitor_config_path=MONITOR_CONFIG,
                                       monitor_output_dir=str(run / "monitor"),
                                       stop_on_nan=True)]
    if args.nan_at_step:
        class InjectNaN(TrainerCallback):
            def on_step_begin(self, targs, state, control, model=None, **kwargs):
                if state.global_step + 1 == args.nan_at_step:
                    with torch.no_grad():
                        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
        callbacks.insert(0, InjectNaN())

    training_args = TrainingArguments(output_dir=str(run / "trainer"), max_steps=args.steps, per_device_train_batch_size=4,
                                      gradient_accumulation_steps=args.grad_acc, learning_rate=1e-3, logging_steps=1,
                                      save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=training_args, train_dataset=SyntheticTokens(), callbacks=callbacks)
    trainer.train()

    mon = run / "monitor"
    anomaly_files = sorted(mon.rglob("anomal*.json"))
    n_anomalies = sum(len(json.loads(p.read_text())) for p in anomaly_files)
    print("\n" + "=" * 72)
    print("msprobe demo finished: a Trainer run with MsprobeCallback (dump + monitor + alerts)")
    print(f"  dump (one folder per optimizer step): {run / 'dump'}")
    print(f"    e.g. {next((run / 'dump').glob('step*/*/dump.json'), 'no dump written')}")
    print(f"  TensorBoard event files:              {mon}  (tags: <module or parameter>/<kind>_<op>)")
    print(f"  CSV files:                            {mon / 'rank0'}")
    print(f"  anomalies ({n_anomalies}):".ljust(40) + (", ".join(map(str, anomaly_files)) or "none (healthy run); try --nan-at-step 3"))
    print(f"  hyperparameters:                      {run / 'dump' / 'hyperparameters.json'}")
    print(f"                                        {mon / 'hyperparameters.json'}")
    print(f"  look at them:  tensorboard --logdir {mon}")
    print(f"  list alerts:   python -m msprobe_core anomalies {mon}")
    print(f"  compare runs:  python -m msprobe_core compare -t {run / 'dump'} -g <another dump> -o compare_out")
    print("=" * 72)


if __name__ == "__main__":
    main()
