"""Real DeepSpeed on the CPU for the DeepSpeed integration tests: a tiny model, fixed data, ds_configs and
the training loops, run inside subprocesses (``python tests/msprobe_integrations/deepspeed/ds_support.py MODE OUT.json``) so that the
process group, the one-time op compile and DeepSpeed's global state stay out of the pytest process.

Modes:
* ``matrix``: one process (world size 1) trains the same model and data under ZeRO 0, 1, 2 and 3, each
  once without and once with ``patch_engine`` (dump + monitor), and writes losses, monitor metrics per step,
  dump folders and patch/unpatch checks to OUT.json; then ZeRO-2 and 3 with the global batch of ``dist``,
  and ZeRO 0 and 2 in fp16 (loss scale 16).
* ``dist``: run under ``torchrun --nproc_per_node 2``: ZeRO-2 with the monitor on both ranks, then ZeRO-3
  with ``module_ranks: [0]`` (rank 1 collects nothing yet must join the scalar all-reduces); each rank
  writes OUT.rank{R}.json.
* ``hf``: the Hugging Face Trainer with a ZeRO-2 ds_config, without and with ``MsprobeCallback``.
* ``capture``: ZeRO-2 with a NaN put into a weight, without and with the monitor's ``on_anomaly.dump``.
* ``config_check``: ZeRO-2 without the tool, then three config_check packs (``config_check_path``): ``a`` and
  ``same`` from ``initialize`` at the first learning rate, ``lr`` from ``patch_engine`` at twice that.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

ROOT = str(Path(__file__).resolve().parents[3])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MICRO = 4
GAS = 2
STEPS = 3
SEED = 0
CLIP = 0.05
"""Gradient clipping that really clips (the monitor must report the gradients before it)."""
MONITOR = {"targets": {}, "xy_distribution": True, "wg_distribution": True, "mv_distribution": True,
           "param_distribution": True, "ops": ["min", "max", "norm", "mean", "zeros", "nans"], "format": ["csv", "api"],
           "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]}}


def child_env(**extra: str) -> dict:
    """The environment of a DeepSpeed child process: the CPU accelerator, this checkout importable, none of
    the parent's process-group variables, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false", **extra)
    return env


def run_single(mode: str, out: Path, port: int, script: str = __file__) -> dict:
    """``python SCRIPT MODE OUT`` (default this file) as a one-process group on ``port`` (from the test); the JSON
    it wrote."""
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    proc = subprocess.run([sys.executable, script, mode, str(out)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def single_process_env(port: int) -> None:
    """The environment DeepSpeed's CPU accelerator needs for a one-process group (gloo)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)


def allow_fp16_on_any_cpu() -> None:
    """Lets DeepSpeed run its fp16 (loss-scaling) path on every CPU.

    DeepSpeed's CPU accelerator allows fp16 only where oneDNN has fp16 kernels
    (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX-512 FP16 or AMX), and ``deepspeed.initialize``
    refuses ``fp16.enabled`` elsewhere ("Type fp16 is not supported on your device"). torch itself computes
    fp16 on any x86-64 CPU (through float32), so the loss scaler, the unscaled gradients and the skipped
    overflow steps behave the same: the test harness says so to the accelerator instead of skipping.
    """
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def attempt(section: dict, key: Any, run) -> None:
    """Runs one configuration into ``section[key]``; one that cannot run on this machine records why
    (``{"error": ...}``) instead of taking the other configurations down with it."""
    try:
        section[key] = run()
    except Exception as e:  # noqa: BLE001 - reported to the test that needs this configuration
        section[key] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"}


def init_distributed() -> None:
    import deepspeed
    import torch

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")


def tiny_model():
    """Odd sizes, so the ZeRO partitions of two ranks cut parameters in the middle and stage 3 pads."""
    import torch

    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))


def batches(n: int, size: int, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 7, generator=g), torch.randn(size, 5, generator=g)) for _ in range(n)]


def ds_config(stage: int, micro: int = MICRO, gas: int = GAS, clip: float = 0.0, world: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "train_batch_size": micro * gas * world, "zero_optimization": {"stage": stage},
            "gradient_clipping": clip, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


def make_engine(stage: int, micro: int = MICRO, world: int = 1, clip: float = 0.0, fp16: bool = False,
                lr: float = 1e-2, **patch: Any):
    """A fresh engine (same initial weights every time) with a ``torch.optim.AdamW`` passed in; with
    ``patch`` keywords it comes from ``msprobe_integrations.deepspeed.initialize`` (the drop-in)."""
    import deepspeed
    import torch

    from msprobe_integrations import deepspeed as msds

    model = tiny_model()
    # two param groups (as the HF Trainer makes): ZeRO links optimizer states per group
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}], lr=lr)
    config = ds_config(stage, micro=micro, world=world, clip=clip)
    if fp16:  # a loss scale of 16: the monitor must report unscaled gradients
        config["fp16"] = {"enabled": True, "initial_scale_power": 4}
    init = msds.initialize if patch else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=opt, config=config, **patch)
    return engine


def train(engine, data, metrics_of: Optional[Any] = None, cast: Any = None) -> tuple[list[float], list[Any]]:
    """Micro-batches ``data`` through the engine; the losses (as float hex: bit-exact) and, after each
    boundary, ``metrics_of(engine)``."""
    import torch

    losses, metrics = [], []
    for x, y in data:
        pred = engine(x)
        loss = torch.nn.functional.mse_loss(pred if cast is None else pred.to(cast), y)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        losses.append(float(loss.item()).hex())
        if boundary and metrics_of is not None:
            metrics.append(metrics_of(engine))
    return losses, metrics


def monitor_metrics(engine) -> Any:
    from msprobe_integrations.deepspeed import get_patch

    norm = engine.get_global_grad_norm()  # DeepSpeed's own, before clipping (ZeRO; None at stage 0 fp32)
    return dict(get_patch(engine).session.monitor.get_metrics(), ds_grad_norm=None if norm is None else float(norm))


def weights_of(engine) -> list[list[float]]:
    import torch

    from deepspeed.utils import safe_get_full_fp32_param
    out = []
    for p in engine.module.parameters():
        full = safe_get_full_fp32_param(p) if hasattr(p, "ds_id") else p.detach()
        out.append(full.reshape(-1).tolist() if isinstance(full, torch.Tensor) else [])
    return out


def _patched_stage(stage: int, data: list, work: Path) -> dict:
    """One ZeRO stage without and with the patch (dump + monitor), then patch/unpatch checks."""
    from msprobe_core.pytorch import PrecisionDebugger
    from msprobe_integrations.deepspeed import get_patch, patch_engine, unpatch

    ref_engine = make_engine(stage, clip=CLIP)
    ref_losses, _ = train(ref_engine, data[:STEPS * GAS])
    ref_weights = weights_of(ref_engine)
    dump, mon = work / f"dump_z{stage}", work / f"mon_z{stage}"
    dump_cfg = {"task": "statistics", "level": "L0", "dump_path": str(dump)}
    configs = dict(config_path=dump_cfg, monitor_config_path=MONITOR, monitor_output_dir=str(mon))
    if stage == 1:  # the drop-in for deepspeed.initialize
        engine = patched = make_engine(stage, clip=CLIP, **configs)
    else:
        engine = make_engine(stage, clip=CLIP)
        patched = patch_engine(engine, **configs)
    again = patch_engine(engine, **configs)  # idempotent: no second layer of wrappers
    patch = get_patch(engine)
    single_layer = all(not hasattr(getattr(engine, name).__wrapped__, "__wrapped__")
                       for name in ("forward", "step", "_take_model_step"))
    try:
        losses, metrics = train(engine, data[:STEPS * GAS], monitor_metrics)
        weights = weights_of(engine)
        reader = type(patch.reader).__name__
    finally:
        unpatch(engine)
    restored = all(name not in engine.__dict__ for name in ("forward", "step", "_take_model_step", "_msprobe_patch"))
    after, _ = train(engine, data[STEPS * GAS:])  # after unpatch: nothing more is dumped or monitored
    PrecisionDebugger.reset()
    return {
        "ref_losses": ref_losses, "losses": losses, "weights_equal": ref_weights == weights,
        "metrics": metrics, "reader": reader, "same_engine": patched is engine and again is engine,
        "single_layer": single_layer, "restored": restored, "losses_after_unpatch": after,
        "dump": str(dump), "monitor": str(mon), "global_steps": int(engine.global_steps),
    }


def _global_batch(stage: int, big: list, work: Path) -> dict:
    """ZeRO-2/3 on one process with the global batch of the two-process run."""
    from msprobe_integrations.deepspeed import patch_engine, unpatch

    engine = make_engine(stage, micro=MICRO * 2)
    patch_engine(engine, monitor_config_path=MONITOR, monitor_output_dir=str(work / f"mon_global_z{stage}"))
    try:
        losses, metrics = train(engine, big, monitor_metrics)
    finally:
        unpatch(engine)
    return {"losses": losses, "metrics": metrics}


def _fp16(stage: int, data: list, work: Path) -> dict:
    """fp16 with a loss scale of 16 (see ``allow_fp16_on_any_cpu``)."""
    import torch

    from msprobe_integrations.deepspeed import patch_engine, unpatch

    engine = make_engine(stage, fp16=True)
    patch_engine(engine, monitor_config_path=dict(MONITOR, xy_distribution=False),
                 monitor_output_dir=str(work / f"mon_fp16_z{stage}"))
    try:
        half = [(x.half(), y) for x, y in data[:STEPS * GAS]]
        losses, metrics = train(engine, half, monitor_metrics, cast=torch.float32)
    finally:
        unpatch(engine)
    return {"metrics": metrics, "optimizer": type(engine.optimizer).__name__,
            "loss_scale": float(engine._get_optimizer_loss_scale()),
            "onednn_fp16": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())}


def run_matrix(out: Path) -> dict:
    """ZeRO 0-3 in one process, each without and with the patch; then ZeRO-2/3 with the global batch of
    the two-process run; and ZeRO 0 and 2 in fp16. Each configuration is attempted on its own."""
    work = out.parent
    t0 = time.time()
    single_process_env(29561)
    init_distributed()
    result: dict[str, Any] = {"init_s": time.time() - t0, "stages": {}, "global": {}, "fp16": {}}
    data = batches(STEPS * GAS + 2, MICRO)
    for stage in (0, 1, 2, 3):
        attempt(result["stages"], stage, lambda: _patched_stage(stage, data, work))
    big = batches(STEPS * GAS, MICRO * 2)
    for stage in (2, 3):
        attempt(result["global"], stage, lambda: _global_batch(stage, big, work))
    allow_fp16_on_any_cpu()
    for stage in (0, 2):
        attempt(result["fp16"], stage, lambda: _fp16(stage, data, work))
    result["total_s"] = time.time() - t0
    return result


def run_dist(out: Path) -> dict:
    """Two processes (torchrun): ZeRO-2 with the monitor on both ranks; then ZeRO-3 with the monitor on
    rank 0 only (``module_ranks: [0]``): rank 1 must still join the scalar all-reduces."""
    import torch

    from msprobe_integrations.deepspeed import patch_engine, unpatch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    init_distributed()
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    work = out.parent
    full = batches(STEPS * GAS, MICRO * world)
    mine = [(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]) for x, y in full]
    result: dict[str, Any] = {"rank": rank, "world": world}
    for name, stage, config in (("z2", 2, MONITOR), ("z3_rank0", 3, dict(MONITOR, module_ranks=[0]))):
        engine = make_engine(stage, world=world)
        patch_engine(engine, monitor_config_path=config, monitor_output_dir=str(work / f"mon_{name}"))
        losses, metrics = train(engine, mine, monitor_metrics)
        unpatch(engine)
        result[name] = {"losses": losses, "metrics": metrics}
    return result


def run_hf(out: Path) -> dict:
    """The HF Trainer with a ZeRO-2 ds_config, with and without ``MsprobeCallback``."""
    single_process_env(29563)
    if os.path.join(ROOT, "tests", "support") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
    from transformers import Trainer

    from hf_support import TokenDataset, tiny_llama, training_args
    from msprobe_integrations.hf import MsprobeCallback

    work = out.parent
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9}
    kw = dict(deepspeed=ds, gradient_accumulation_steps=2, max_grad_norm=0.5)
    result: dict[str, Any] = {}
    for name, with_callback in (("ref", False), ("tool", True)):
        callbacks = []
        if with_callback:
            callbacks = [MsprobeCallback(config_path={"task": "statistics", "level": "L0", "dump_path": str(work / "hf_dump")},
                                         monitor_config_path=dict(MONITOR, xy_distribution=False),
                                         monitor_output_dir=str(work / "hf_mon"))]
        trainer = Trainer(model=tiny_llama(), args=training_args(work / f"hf_{name}", **kw), train_dataset=TokenDataset(),
                          callbacks=callbacks)
        grad_norms: list = []
        if with_callback:
            from transformers import TrainerCallback

            class Spy(TrainerCallback):
                def on_step_end(self, args, state, control, **kwargs):
                    grad_norms.append(callbacks[0].session.monitor.get_metrics())

            trainer.add_callback(Spy())
        trainer.train()
        result[name] = {"losses": [float(h["loss"]).hex() for h in trainer.state.log_history if "loss" in h],
                        "grad_norm": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
                        "metrics": grad_norms,
                        "engine": type(trainer.model_wrapped).__name__,
                        "optimizer": type(trainer.model_wrapped.optimizer).__name__}
    return result


def run_config_check(out: Path) -> dict:
    """ZeRO-2 without the tool, then with ``config_check_path`` through both entry points: the drop-in
    ``initialize`` (packs ``a`` and ``same``, learning rate 1e-2) and ``patch_engine`` (pack ``lr``, 2e-2)."""
    from msprobe_integrations.deepspeed import patch_engine, unpatch

    single_process_env(29565)
    init_distributed()
    data = batches(STEPS * GAS, MICRO)
    ref_losses, _ = train(make_engine(2), data)
    result: dict[str, Any] = {"ref_losses": ref_losses, "packs": {}, "losses": {}}
    for name, lr in (("a", 1e-2), ("lr", 2e-2), ("same", 1e-2)):
        pack = out.parent / f"{name}.zip"
        if name == "lr":
            engine = patch_engine(make_engine(2, lr=lr), config_check_path=str(pack))
        else:
            engine = make_engine(2, lr=lr, config_check_path=str(pack))
        try:
            result["losses"][name], _ = train(engine, data)
        finally:
            unpatch(engine)
        result["packs"][name] = str(pack)
    return result


def run_capture(out: Path) -> dict:
    """ZeRO-2 with the monitor's NaN alert, once without and once with ``on_anomaly.dump``: a NaN put into
    ``2.weight`` before the third optimizer step; the losses (hex) and the alert's capture folder."""
    import torch

    from msprobe_integrations.deepspeed import get_patch, patch_engine, unpatch

    single_process_env(29567)
    init_distributed()
    data = batches(5 * GAS, MICRO)
    config = {"xy_distribution": True, "ops": ["min", "max", "norm", "nans"], "format": ["csv"],
              "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}}
    result: dict[str, Any] = {}
    for name, extra in (("ref", {}), ("capture", {"on_anomaly": {"dump": {"level": "mix"}}})):
        engine = make_engine(2)
        patch_engine(engine, monitor_config_path=dict(config, **extra), monitor_output_dir=str(out.parent / name))
        monitor = get_patch(engine).session.monitor
        losses = []
        try:
            for i, (x, y) in enumerate(data):
                if i == 2 * GAS:
                    with torch.no_grad():
                        engine.module[2].weight.view(-1)[3] = math.nan
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.item()).hex())
        finally:
            unpatch(engine)
        first = monitor.anomalies[0]
        result[name] = {"losses": losses, "step": first.step, "module": first.module, "capture": first.capture}
    return result


def main(argv: list[str]) -> None:
    mode, out = argv[0], Path(argv[1])
    result = {"matrix": run_matrix, "dist": run_dist, "hf": run_hf, "config_check": run_config_check,
              "capture": run_capture}[mode](out)
    if mode == "dist":
        out = out.with_name(f"{out.stem}.rank{result['rank']}{out.suffix}")
    out.write_text(json.dumps(result))
    from msprobe_core.session import finish_distributed

    finish_distributed()  # the engines and trainers were local to the run: released, then the groups go


if __name__ == "__main__":
    main(sys.argv[1:])
