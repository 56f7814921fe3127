"""An update Megatron's loss scaler skips is a skipped step, not NaN/Inf anomalies: real megatron-core on the
CPU (a tiny ``GPTModel`` in bf16 with a constant loss scale, so ``Float16OptimizerWithFloat16Params`` checks
the gradients for Inf/NaN), the probe attached as the Megatron flags attach it.

Iteration 2 gets an Inf in one gradient after the forward-backward schedule: Megatron's ``optimizer.step()``
returns ``update_successful=False`` and leaves the weights alone; the monitor reports step 2 as skipped.
Runs in a subprocess (the CPU patches and the process group stay out of the pytest process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    import torch
    sys.path.insert(0, {support!r})
    import megatron_support as ms
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from msprobe_integrations.megatron import MegatronProbe

    patches = ms.CpuPatches().install()
    ms.init_distributed()
    ms.initialize_model_parallel()
    model = ms.wrap_ddp(ms.gpt_chunks(ms.transformer_config(bf16=True), seed=0))
    config = ms.optimizer_config(bf16=True)
    config.loss_scale = 1.0          # a constant grad scaler: the optimizer checks for Inf/NaN and may skip
    optimizer = ms.megatron_optimizer(model, config)
    ms.set_schedule_hooks(model, optimizer)
    monitor = {{"targets": {{}}, "wg_distribution": True, "ops": ["min", "max", "norm", "nans"], "format": ["api"],
               "alert": {{"rules": [{{"rule_name": "AnomalyTurbulence", "args": {{"threshold": 0.5}}}}]}}}}
    probe = MegatronProbe(monitor_config_path=monitor, monitor_output_dir={out!r}, capture_hyperparameters=False)
    args = SimpleNamespace(micro_batch_size=4, global_batch_size=8, iteration=0)
    probe.setup(model, optimizer, None, args)
    param = dict(model[0].module.named_parameters())["decoder.layers.0.mlp.linear_fc1.weight"]
    data, step_fn = ms.batches(4, seed=1), get_forward_backward_func()
    successful = []
    for i in range(1, 4):
        probe.begin_iteration(i)
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        step_fn(forward_step_func=ms.forward_step, data_iterator=data, model=model, num_microbatches=2,
                seq_length=ms.SEQ, micro_batch_size=4, forward_only=False)
        if i == 2:
            with torch.no_grad():
                param.main_grad.view(-1)[0] = float("inf")
        successful.append(optimizer.step()[0])
        probe.end_iteration()
    mon = probe.session.monitor
    result = {{"successful": successful, "skipped": [s.step for s in mon.skipped_steps],
               "overflowed": [list(s.overflowed) for s in mon.skipped_steps],
               "anomalies": [a.describe() for a in mon.anomalies]}}
    probe.close()
    restored = "step" not in vars(optimizer)
    del model, optimizer, param, mon, probe       # the DDP chunks hold the groups: released before they go
    ms.destroy()
    patches.remove()
    print("RESULT " + json.dumps(dict(result, restored=restored)))
""")


def test_an_update_the_loss_scaler_skipped_is_reported_as_skipped(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    script = SCRIPT.format(support=str(ROOT / "tests" / "support"), out=str(tmp_path / "mon"))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert result["successful"] == [True, False, True]   # Megatron's own verdict
    assert result["skipped"] == [2]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in result["overflowed"][0]
    assert result["anomalies"] == []
    assert result["restored"]                              # close() took both layers off optimizer.step
