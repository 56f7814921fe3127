"""Overhead of the training monitor on the small-GPT workload (CPU), as a ratio to no monitor.

Each configuration runs in a fresh process (``--worker``), the same workload with and without the
tool: ``benchmarks.small_gpt`` (4 layers, hidden 256, 4 heads, seq 128, batch 8, AdamW). Step times are
taken after ``--warmup`` steps; the reported time of a configuration is the median step time over
all its runs, and runs of the configurations are interleaved (``--rounds``) so a busy machine slows
them all alike. CPU-time ratios are printed too: they are far less sensitive to other processes on a
shared machine. Every run's losses are compared bit for bit with the first unmonitored run (the
"none" row compares the unmonitored runs with each other: any difference there is the CPU backend's
own run-to-run nondeterminism, not the monitor).

Configurations (by default all with ops min, max, norm, mean, zeros, nans and format csv, as msprobe's
documented example; ``--ops`` and ``--format`` change that):

    everything   xy (forward + backward, all modules) + weight grads + moments + weights
    activations  xy only
    grads+moments  weight grads + Adam moments
    grads        weight grads only

``--model moe`` runs the same on ``benchmarks.small_moe`` (the small GPT's size as an HF Qwen3-MoE, 8 experts,
top-2): "everything" then also measures per-expert rows of the fused expert tensors, router health per
layer and the MoE alert rules.

Usage: ``python benchmarks/monitor_overhead.py [--model gpt|moe] [--steps 8] [--rounds 2] [--format csv]
[--ops norm,max]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OPS = ["min", "max", "norm", "mean", "zeros", "nans"]
CONFIGS: dict[str, dict | None] = {
    "none": None,
    "everything": {"xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": True},
    "activations": {"xy_distribution": True},
    "grads+moments": {"wg_distribution": True, "mv_distribution": True},
    "grads": {"wg_distribution": True},
}
TARGETS = {"everything": 1.5, "activations": 1.4, "grads+moments": 1.1, "grads": 1.05}
MODELS = ("gpt", "moe")
MOE_RULES = [{"rule_name": "ExpertStarvation"}, {"rule_name": "ImbalanceJump"}, {"rule_name": "EntropyCollapse"}]


def worker(name: str, steps: int, warmup: int, fmt: str, out_dir: str, ops: list[str], threads: int,
           model_name: str = "gpt") -> dict:
    """Train ``warmup + steps`` steps of ``model_name`` with configuration ``name``; step times and losses."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)

    from benchmarks.small_gpt import timed_train

    if model_name == "moe":
        from benchmarks.small_moe import build
    else:
        from benchmarks.small_gpt import build
    model, opt, data = build()
    mon = None
    if CONFIGS[name] is not None:
        from msprobe_core.monitor.trainer_mon import TrainerMon

        rules = [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]
        cfg = dict(CONFIGS[name], ops=ops, format=fmt, alert={"rules": rules + (MOE_RULES if model_name == "moe" else [])})
        path = Path(out_dir) / f"{name}.json"
        path.write_text(json.dumps(cfg))
        mon = TrainerMon(str(path), output_dir=str(Path(out_dir) / name))
        mon.set_monitor(model, 1, opt)
    losses, times, cpu = timed_train(model, opt, data, steps, warmup)
    if mon is not None:
        mon.close()
    return {"name": name, "times": times, "cpu": cpu, "losses": losses, "threads": torch.get_num_threads(),
            "anomalies": len(mon.anomalies) if mon is not None else 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--rounds", type=int, default=2, help="runs of every configuration (interleaved)")
    p.add_argument("--format", default="csv", help="monitor output format (csv, tensorboard, api)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated statistics (default: all six)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default). With 1, the cpu column is the whole work "
                        "of a step, which makes ratios stable on a machine other jobs are using")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    p.add_argument("--model", default="gpt", choices=MODELS, help="small GPT (dense) or its MoE twin")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.warmup, args.format, args.out, args.ops.split(","),
                                args.threads, args.model)))
        return 0

    names = [n for n in args.configs.split(",") if n]
    if "none" not in names:
        names.insert(0, "none")
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[list[float]]] = {n: [] for n in names}
    anomalies: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="monitor_bench_") as tmp:
        for _ in range(args.rounds):
            for name in names:
                cmd = [sys.executable, __file__, "--worker", name, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--format", args.format, "--ops", args.ops,
                       "--threads", str(args.threads), "--model", args.model, "--out", tmp]
                path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
                res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
                if res.returncode != 0:
                    print(res.stderr, file=sys.stderr)
                    return 1
                r = json.loads(res.stdout.strip().splitlines()[-1])
                times[name].extend(r["times"])
                cpu[name].extend(r["cpu"])
                losses[name].append(r["losses"])
                anomalies[name] = anomalies.get(name, 0) + r["anomalies"]
    base = statistics.median(times["none"])
    base_cpu = statistics.median(cpu["none"])
    threads = args.threads or "default"
    workload = "small GPT" if args.model == "gpt" else "small MoE (Qwen3-MoE, 8 experts, top-2)"
    print(f"{workload}, CPU ({os.cpu_count()} cores, torch threads: {threads}), {args.steps} steps x {args.rounds} "
          f"runs, ops {args.ops}, format {args.format}")
    print("ratio: median wall-clock step time over no monitor; best: fastest step over fastest step; "
          "cpu: median process CPU time (best and cpu are less sensitive to other load on a shared machine)")
    print(f"{'configuration':15s} {'median step':>12s} {'ratio':>7s} {'best':>7s} {'cpu':>7s} {'target':>7s}  "
          f"losses identical (max diff)  alerts")
    best_base = min(times["none"])
    reference = losses["none"][0]
    for name in names:
        med = statistics.median(times[name])
        med_cpu = statistics.median(cpu[name])
        diff = max(abs(a - b) for run in losses[name] for a, b in zip(run, reference))
        same = f"{str(diff == 0.0):5s} ({diff:.1e})"
        target = f"<={TARGETS[name]}x" if name in TARGETS else ""
        print(f"{name:15s} {med * 1e3:10.1f}ms {med / base:6.2f}x {min(times[name]) / best_base:6.2f}x "
              f"{med_cpu / base_cpu:6.2f}x {target:>7s}  "
              f"{same:27s}  {anomalies.get(name, 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
