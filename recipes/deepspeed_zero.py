"""Dump and monitor a DeepSpeed engine under ZeRO stage 0, 1, 2 or 3 with one call (``patch_engine``).

A small MLP trains on random data with a ``torch.optim.AdamW`` passed to ``deepspeed.initialize`` and
gradient accumulation. The engine is patched right after ``deepspeed.initialize``: the dump writes one
``stepN`` folder per optimizer step (N = ``engine.global_steps``, every micro-batch of the accumulation
window inside it), and the monitor writes gradient, weight and Adam-state statistics read where ZeRO keeps
them (combined over the data-parallel ranks without gathering), plus ``hyperparameters.json``. On the CPU it
runs in seconds (DeepSpeed compiles one small C++ op on its very first use: about 40 s, once).

    python recipes/deepspeed_zero.py                    # ZeRO-2, one process
    python recipes/deepspeed_zero.py --stage 3 --steps 5 --grad-acc 4
    torchrun --nproc_per_node 2 recipes/deepspeed_zero.py --stage 2   # two ranks: identical norms on both

The same lines work in any DeepSpeed script (see ``main``)::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    engine = patch_engine(engine, config_path="dump.json", monitor_config_path="monitor.json")
    ...  # engine(x); engine.backward(loss); engine.step()
    unpatch(engine)          # the last dump step and the monitor's files are written
    engine.destroy()
    del engine, optimizer, model
    finish_distributed()     # from msprobe_core.session: release the engine first, then the process group
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from a checkout without installing the package
    sys.path.insert(0, str(ROOT))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Outputs: OUT/dump/step{N}/rank{R}/dump.json, OUT/monitor/rank{R}/*.csv and "
                                       "hyperparameters.json at the top of both.")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=2, help="ZeRO stage (default: 2)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default: 3)")
    p.add_argument("--grad-acc", type=int, default=2, help="micro-batches per optimizer step (default: 2)")
    p.add_argument("--micro-batch", type=int, default=4, help="micro-batch size per rank (default: 4)")
    p.add_argument("--clip", type=float, default=1.0, help="ds_config gradient_clipping (default: 1.0)")
    p.add_argument("--level", choices=["L0", "L1", "mix"], default="L0", help="dump level (default: L0)")
    p.add_argument("--no-dump", action="store_true", help="monitor only")
    p.add_argument("--no-monitor", action="store_true", help="dump only")
    p.add_argument("--out", help="output folder (default: a new folder under ./deepspeed_zero_output)")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and the data (default: 0)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.grad_acc < 1 or args.micro_batch < 1:
        p.error("--steps, --grad-acc and --micro-batch must be >= 1")
    if args.no_dump and args.no_monitor:
        p.error("--no-dump and --no-monitor together leave nothing to do")
    return args


def single_process_defaults() -> None:
    """Without a launcher: a one-process group on the CPU (gloo); launchers set these themselves."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    single_process_defaults()
    import deepspeed
    import torch

    from msprobe_core.session import finish_distributed
    from msprobe_integrations.deepspeed import get_patch, patch_engine, unpatch

    t0 = time.time()
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if os.environ.get("DS_ACCELERATOR") == "cpu" else None)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = Path(args.out or Path("deepspeed_zero_output") / time.strftime(f"z{args.stage}_%Y%m%d_%H%M%S")).resolve()
    if world > 1:  # every rank must write into the same folder
        name = [str(out)]
        torch.distributed.broadcast_object_list(name, src=0)
        out = Path(name[0])

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ds_config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.grad_acc,
                 "train_batch_size": args.micro_batch * args.grad_acc * world, "gradient_clipping": args.clip,
                 "zero_optimization": {"stage": args.stage}, "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    dump_cfg = None if args.no_dump else {"task": "statistics", "level": args.level, "dump_path": str(out / "dump")}
    monitor_cfg = None if args.no_monitor else {
        "targets": {}, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
        "xy_distribution": True, "ops": ["min", "max", "norm", "mean", "nans"], "format": ["csv", "api"],
        "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True}}
    engine = patch_engine(engine, config_path=dump_cfg, monitor_config_path=monitor_cfg,
                          monitor_output_dir=str(out / "monitor"))
    patch = get_patch(engine)

    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    for _ in range(args.steps * args.grad_acc):
        x = torch.randn(args.micro_batch, 16, generator=g)
        y = torch.randn(args.micro_batch, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary and rank == 0:
            line = f"step {engine.global_steps - 1}: loss {loss.item():.5f}"
            if patch.session.monitor is not None and patch.session.monitor.get_metrics():
                grads = patch.session.monitor.get_metrics()["metrics"].get("grad", {})
                total = sum(row["norm"] ** 2 for row in grads.values()) ** 0.5
                ds_norm = engine.get_global_grad_norm()  # None at stage 0 without fp16/bf16
                line += f", gradient norm before clipping {total:.5f}"
                line += f" (DeepSpeed's: {float(ds_norm):.5f})" if ds_norm is not None else ""
            print(line, flush=True)
    reader = type(patch.reader).__name__ if patch.reader is not None else "-"
    unpatch(engine)
    engine.destroy()  # DeepSpeed's own release of the engine's optimizer state and hooks
    del engine, patch, optimizer, model  # the engine holds the process group: release it before the group goes
    finish_distributed()  # every rank has written its last dump step; the process groups are destroyed

    if rank == 0:
        print(f"\nZeRO-{args.stage}, {world} rank(s), {args.steps} steps x {args.grad_acc} micro-batches, "
              f"state reader {reader}, {time.time() - t0:.1f} s")
        if dump_cfg:
            steps = sorted(p.name for p in (out / "dump").iterdir() if p.is_dir())
            print(f"dump:    {out / 'dump'}  ({', '.join(steps)}; each holds rank*/dump.json)")
        if monitor_cfg:
            print(f"monitor: {out / 'monitor'}  (rank*/grad_*.csv, param_*.csv, exp_avg*_*.csv, actv*_*.csv)")
        hp = out / ("dump" if dump_cfg else "monitor") / "hyperparameters.json"
        if hp.exists():
            norm = json.loads(hp.read_text())["normalized"]
            keys = ("zero_stage", "micro_batch_size", "gradient_accumulation_steps", "global_batch_size",
                    "mixed_precision", "optimizer", "learning_rate")
            print(f"hyperparameters: {hp}  " + ", ".join(f"{k}={norm.get(k)}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
