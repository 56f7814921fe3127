"""An update DeepSpeed's fp16 loss scaler skips is a skipped step, not NaN/Inf anomalies: real DeepSpeed on
the CPU (fp16, loss scale 16: ``ds_support.allow_fp16_on_any_cpu``), ZeRO 0 and 2, through ``patch_engine``
and through the engine follower the Hugging Face Trainer uses (``follow_engine("deepspeed", ...)``).

The second optimizer step's loss is multiplied by 1e30: its fp16 gradients overflow, the engine counts a
skipped step (``engine.skipped_steps``) and halves the loss scale. Runs in a subprocess (DeepSpeed's global
state stays out of the pytest process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from dist_run import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {here!r})
    import ds_support as S
    from msprobe_core.session import ProbeSession, finish_distributed
    from msprobe_integrations.deepspeed import get_patch, patch_engine, unpatch

    S.single_process_env({port})
    S.allow_fp16_on_any_cpu()
    MONITOR = dict(S.MONITOR, xy_distribution=False)
    data = [(x.half(), y) for x, y in S.batches(3 * S.GAS, S.MICRO)]

    def train(engine):
        for i, (x, y) in enumerate(data):
            loss = torch.nn.functional.mse_loss(engine(x).float(), y)
            engine.backward(loss * 1e30 if i // S.GAS == 1 else loss)   # the second optimizer step overflows
            engine.step()

    def summary(engine, monitor):
        return {{"engine_skipped": int(engine.skipped_steps), "global_steps": int(engine.global_steps),
                 "skipped": [s.step for s in monitor.skipped_steps],
                 "overflowed": [list(s.overflowed) for s in monitor.skipped_steps],
                 "anomalies": [a.describe() for a in monitor.anomalies]}}

    out = {{}}
    for stage in (0, 2):
        engine = S.make_engine(stage, fp16=True)
        patch_engine(engine, monitor_config_path=MONITOR, monitor_output_dir={out!r} + f"/patch_z{{stage}}")
        monitor = get_patch(engine).session.monitor
        train(engine)
        out[f"patch_z{{stage}}"] = summary(engine, monitor)
        unpatch(engine)
        # the follower (the HF Trainer's route under DeepSpeed): labels come from the caller
        engine = S.make_engine(stage, fp16=True)
        session = ProbeSession(None, MONITOR, monitor_output_dir={out!r} + f"/follow_z{{stage}}")
        session.attach(engine.module, grad_acc_steps=S.GAS, start_iteration=1)
        session.follow_engine("deepspeed", lambda: int(engine.global_steps))  # read after the step
        train(engine)
        out[f"follow_z{{stage}}"] = summary(engine, session.monitor)
        session.close()
    del engine, session, monitor     # the engines hold the process group: released before it goes
    print("RESULT " + json.dumps(out))
    finish_distributed()
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ds_skipped")
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(here=str(HERE), port=free_port(), out=str(out))],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("route", ["patch", "follow"])
@pytest.mark.parametrize("stage", [0, 2])
def test_a_step_the_fp16_loss_scaler_skipped_is_reported_as_skipped(runs, route, stage):
    run = runs[f"{route}_z{stage}"]
    assert run["engine_skipped"] == 1 and run["global_steps"] == 3
    label = 1 if route == "patch" else 2   # engine.global_steps before the step (patch_engine), after it (here)
    assert run["skipped"] == [label]
    assert run["overflowed"][0], "the gradient seen overflowing first is named"
    assert run["anomalies"] == []          # the overflowed gradients are why the scaler skipped, not anomalies
