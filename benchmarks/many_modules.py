"""Per-record cost of the dump and the monitor on a model of many small modules (CPU, 2 threads; or a GPU).

The small GPT's step is heavy (0.2 s over about 30 modules), so a fixed cost per module or per API call hides
in it. Here the model is an MLP of ``--layers`` x (``Linear(64, 64)``, ``GELU``) (400 by default; ``--deep``
runs 1,600 to show how the cost grows), batch 32, AdamW. Each configuration runs in a fresh process, the
configurations interleaved over ``--rounds``; a run trains ``--warmup`` + ``--steps`` steps and reports the
median wall-clock and process CPU time of the measured steps (by default steps 2-7, as the issue measured).

Columns: the step's median over all runs of a configuration; ratio (wall) and cpu ratio to no tool (the CPU
ratio is far less sensitive to other jobs on a shared machine); the cost per unit, (step - no tool's step) /
units, with units the modules (800 for 400 layers) for the monitor and L0 and the step's dump records
(one per API call or module call, forward and backward, as dump.json holds them) for L1 and mix; and whether
every run's losses equal the unmonitored run's bit for bit.

On a GPU (``--device cuda``) the layers are ``Linear(W, W)``: ``--width W``, or ``--width auto`` (the default
there): the narrowest of 64, 128, ... 4,096 whose step without the tool takes ``--target-ms`` (20 ms) or more, so
that the GPU's work, not Python's, sets the step as on a real model; each step ends with a synchronize. The
goals (``target``) are the CPU's.

    python benchmarks/many_modules.py [--deep] [--layers N] [--steps 6] [--rounds 2] [--only L0,monitor]
    python benchmarks/many_modules.py --device cuda [--width auto|W] [--target-ms 20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import overhead_runner  # noqa: E402

# name -> None (no tool), "monitor" (TrainerMon, everything on) or (level, task) of the dump
CONFIGS: dict[str, object] = {
    "none": None,
    "monitor": "monitor",
    "L0": ("L0", "statistics"),
    "L1": ("L1", "statistics"),
    "mix": ("mix", "statistics"),
}
TARGETS = {"monitor": 1.3, "L0": 1.5, "L1": 2.5, "mix": 3.0}
OPS = ["min", "max", "norm", "mean", "zeros", "nans"]

CHILD = r"""
import json, os, statistics, time
import torch
from torch import nn
torch.set_num_threads(2)
torch.manual_seed(0)
cfg, out, layers, warmup, steps, dev, width = {cfg!r}, {out!r}, {layers}, {warmup}, {steps}, {device!r}, {width}
model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())]).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1)
data = [(torch.randn(32, width, generator=gen).to(dev), torch.randn(32, width, generator=gen).to(dev))
        for _ in range(warmup + steps)]
sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
before = after = lambda: None
mon = None
if cfg == "monitor":
    from msprobe_core.monitor.trainer_mon import TrainerMon
    path = os.path.join(out, "monitor.json")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump({{"xy_distribution": True, "wg_distribution": True, "mv_distribution": True,
                   "param_distribution": True, "ops": {ops!r}, "format": "csv",
                   "alert": {{"rules": [{{"rule_name": "AnomalyTurbulence", "args": {{"threshold": 0.5}}}}]}}}}, f)
    mon = TrainerMon(path, output_dir=os.path.join(out, "out"))
    mon.set_monitor(model, 1, opt)
elif cfg is not None:
    from msprobe_core.pytorch import PrecisionDebugger
    level, task = cfg
    dbg = PrecisionDebugger({{"task": task, "dump_path": out, "level": level, task: {{"summary_mode": "statistics"}}}})
    before = lambda: dbg.start(model)
    after = lambda: (dbg.stop(), dbg.step())
losses, wall, cpu = [], [], []
for x, y in data:
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    before()
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    after()
    sync()
    wall.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
    losses.append(loss.item())
if mon is not None:
    mon.close()
print(json.dumps({{"wall": wall[warmup:], "cpu": cpu[warmup:], "losses": losses}}))
"""


def _records_per_step(out: str) -> int:
    """Records of the first step's dump.json (rank 0), or 0 when there is none."""
    for d, _, files in sorted(os.walk(out)):
        if "dump.json" in files and os.path.basename(os.path.dirname(d)) == "step0":
            with open(os.path.join(d, "dump.json")) as f:
                return len(json.load(f).get("data", {}))
    return 0


def run_config(name: str, layers: int, warmup: int, steps: int, device: str = "cpu", width: int = 64) -> dict:
    """One fresh process of configuration ``name``: its step times, losses and records per step."""
    out = tempfile.mkdtemp(prefix="msprobe_many_")
    shutil.rmtree(out)
    try:
        code = CHILD.format(cfg=CONFIGS[name], out=out, layers=layers, warmup=warmup, steps=steps, ops=OPS,
                            device=device, width=width)
        result = overhead_runner.run_child(code, MKL_NUM_THREADS="2")
        result["records"] = _records_per_step(out)
        return result
    finally:
        shutil.rmtree(out, ignore_errors=True)


WIDTHS = [64 << i for i in range(7)]  # --width auto: 64 ... 4,096


def auto_width(layers: int, device: str, target_ms: float) -> int:
    """The narrowest of ``WIDTHS`` whose step without the tool takes ``target_ms`` or more (the widest if none)."""
    for width in WIDTHS:
        step = statistics.median(run_config("none", layers, 2, 3, device, width)["wall"]) * 1e3
        print(f"width {width}: step {step:.1f} ms without the tool", flush=True)
        if step >= target_ms:
            return width
    return WIDTHS[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=400, help="(Linear, GELU) pairs")
    ap.add_argument("--deep", action="store_true", help="1,600 pairs instead of --layers")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    ap.add_argument("--steps", type=int, default=6, help="measured steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every configuration (interleaved)")
    ap.add_argument("--only", default="", help="comma-separated configurations (default: all)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    ap.add_argument("--width", default="", help="the Linear layers' width: a number, or auto (the default on a GPU: "
                    "the narrowest step of --target-ms or more); 64 on the CPU")
    ap.add_argument("--target-ms", type=float, default=20.0, help="--width auto's step time without the tool")
    args = ap.parse_args(argv)
    layers = 1600 if args.deep else args.layers
    width_arg = args.width or ("64" if args.device == "cpu" else "auto")
    if width_arg != "auto" and not (width_arg.isdigit() and int(width_arg) > 0):
        ap.error(f"--width: {width_arg!r} is neither a positive number nor auto")
    width = auto_width(layers, args.device, args.target_ms) if width_arg == "auto" else int(width_arg)
    names = overhead_runner.selected(CONFIGS, args.only)
    runs = overhead_runner.interleaved(
        names, args.rounds, lambda n: run_config(n, layers, args.warmup, args.steps, args.device, width))
    wall = {n: statistics.median(t for r in runs[n] for t in r["wall"]) for n in names}
    cpu = {n: statistics.median(t for r in runs[n] for t in r["cpu"]) for n in names}
    reference = runs["none"][0]["losses"]
    modules = 2 * layers
    where = f"CPU ({os.cpu_count()} cores, 2 threads)" if args.device == "cpu" else f"{args.device} ({_gpu_name()})"
    print(f"{layers} x (Linear({width}, {width}), GELU), batch 32, AdamW, {where}, "
          f"steps {args.warmup}-{args.warmup + args.steps - 1} x {args.rounds} runs")
    print(f"{'config':<8} {'step ms':>8} {'cpu ms':>8} {'ratio':>6} {'cpu':>6} {'target':>8} {'units':>14} "
          f"{'us/unit':>8} {'cpu us':>7}  losses equal")
    for n in names:
        records = runs[n][-1]["records"]
        units, label = (records, "records") if records and n in ("L1", "mix") else (modules, "modules")
        per = (wall[n] - wall["none"]) / units * 1e6
        per_cpu = (cpu[n] - cpu["none"]) / units * 1e6
        target = f"<= {TARGETS[n]}x" if n in TARGETS else ""
        same = all(r["losses"] == reference for r in runs[n])
        print(f"{n:<8} {wall[n] * 1e3:8.1f} {cpu[n] * 1e3:8.1f} {wall[n] / wall['none']:5.2f}x "
              f"{cpu[n] / cpu['none']:5.2f}x {target:>8} {units:>6} {label:<7} "
              f"{per if n != 'none' else 0:8.0f} {per_cpu if n != 'none' else 0:7.0f}  {same}")
    return 0


def _gpu_name() -> str:
    import torch  # only for the table's title: the runs import it in their own processes

    return torch.cuda.get_device_name()


if __name__ == "__main__":
    sys.exit(main())
