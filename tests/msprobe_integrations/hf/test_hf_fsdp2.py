"""The Hugging Face callback with an FSDP2-sharded model, on two gloo ranks.

Accelerate's FSDP needs an accelerator: ``Trainer`` with ``fsdp=...`` and ``use_cpu=True`` silently falls
back to DDP on this CPU machine, so the callback is driven by a plain loop that calls its events in the
Trainer's order. The monitor (through the callback) writes the single-device statistics of every original
parameter, the dump pairs FSDP2's modules with the unwrapped ones, and the losses are bit-identical with
the callback on and off."""

from __future__ import annotations

import json
import textwrap

import pytest

pytest.importorskip("transformers")

from dist_run import run_two_ranks  # noqa: E402

WORKER = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from msprobe_core.session import finish_distributed
    from native_sharding import make_model, reference, shard, train
    from msprobe_integrations.hf import MsprobeCallback

    tmp = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plain = train(shard(make_model(), "fsdp2"), "fsdp2")
    model = shard(make_model(), "fsdp2")
    monitor = {"xy_distribution": True, "wg_distribution": True, "mv_distribution": True,
               "param_distribution": True, "ops": ["min", "max", "norm", "mean"], "format": ["api", "csv"]}
    cb = MsprobeCallback(config_path={"task": "statistics", "level": "L0", "dump_path": f"{tmp}/dump"},
                         monitor_config_path=monitor, monitor_output_dir=f"{tmp}/mon", capture_hyperparameters=False)
    args = TrainingArguments(output_dir=f"{tmp}/hf", use_cpu=True, report_to=[])
    state, control = TrainerState(), TrainerControl()
    got = []
    def attach(opt):
        cb.on_train_begin(args, state, control, model=model, optimizer=opt)
        real_step = opt.step
        def step(*a, **k):  # the Trainer's order: pre-step event, update, step event
            cb.on_pre_optimizer_step(args, state, control, optimizer=opt)
            out = real_step(*a, **k)
            cb.on_optimizer_step(args, state, control, optimizer=opt)
            state.global_step += 1
            cb.on_step_end(args, state, control)
            got.append(cb.session.monitor.get_metrics().get("metrics", {}))
            cb.on_step_begin(args, state, control)
            return out
        opt.step = step
        cb.on_step_begin(args, state, control)
    losses = train(model, "fsdp2", attach=attach)
    cb.on_train_end(args, state, control)
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump({"plain": plain, "losses": losses, "got": got, "want": reference()}, f)
    finish_distributed()
""")


@pytest.mark.distributed
def test_hf_callback_on_fsdp2_model(tmp_path):
    run_two_ranks(WORKER, tmp_path, str(tmp_path), timeout=240, name="worker.py")
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["losses"] == result["plain"]
        for got, want in zip(result["got"], result["want"]):
            for kind in ("param", "grad", "exp_avg", "exp_avg_sq"):
                for name, ops in want[kind].items():
                    for op, value in ops.items():
                        assert got[kind][name][op] == pytest.approx(value, rel=1e-5, abs=1e-7), (kind, name, op)
        data = json.loads(next((tmp_path / "dump" / "step1").glob(f"rank{rank}/dump.json")).read_text())["data"]
        assert "Module.0.Linear.parameters_grad.0" in data and not any("FSDP" in k for k in data)
