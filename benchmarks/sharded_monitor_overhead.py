"""Overhead of the training monitor (everything on) under FSDP2 beside DDP: the same model, the same run.

Two gloo ranks on the CPU (``torch.distributed.run``), the small-GPT workload of ``benchmarks.small_gpt``
(each rank trains on the same batches), AdamW. Four configurations, each in fresh processes, interleaved
over ``--rounds``: DDP and FSDP2 (``fully_shard`` on every block, then on the model), without and with the
monitor (activations forward and backward, weight gradients, Adam moments, weights; ops min, max, norm,
mean, zeros, nans; csv). Under FSDP2 the monitor reads each rank's shards and combines per-shard partial
statistics with two all-reduces per kind and step (``NativeShardReader``); under DDP every rank holds the
whole tensors. Reported: rank 0's median step time, its ratio to the same setup without the monitor, the
CPU-time ratio (less sensitive to other load), and whether the losses are bit-identical.

Usage: ``python benchmarks/sharded_monitor_overhead.py [--steps 6] [--rounds 2] [--layers 2]``
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

from msprobe_core.common.ports import free_port  # noqa: E402

EVERYTHING = {"xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
              "ops": ["min", "max", "norm", "mean", "zeros", "nans"], "format": "csv"}
RUNS = [("ddp", False), ("ddp", True), ("fsdp2", False), ("fsdp2", True)]


def worker(setup: str, monitored: bool, steps: int, warmup: int, layers: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.small_gpt import GPTConfig, build, timed_train

    dist.init_process_group("gloo")
    model, _, data = build(cfg=GPTConfig(layers=layers))
    if setup == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = None
    if monitored:
        from msprobe_core.monitor.trainer_mon import TrainerMon
        mon = TrainerMon(EVERYTHING, output_dir=str(Path(out_dir) / f"{setup}_mon"))
        mon.set_monitor(model, 1, opt)
    losses, times, cpu = timed_train(model, opt, data, steps, warmup)
    if mon is not None:
        mon.close()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"times": times, "cpu": cpu, "losses": losses}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--rounds", type=int, default=2, help="runs of every configuration (interleaved)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks of the small GPT")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        setup, monitored = args.worker.split(":")
        worker(setup, monitored == "1", args.steps, args.warmup, args.layers, args.out)
        return 0

    results: dict[tuple[str, bool], dict[str, list]] = {run: {"times": [], "cpu": [], "losses": []} for run in RUNS}
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)}
    with tempfile.TemporaryDirectory(prefix="sharded_monitor_bench_") as tmp:
        for _ in range(args.rounds):
            for setup, monitored in RUNS:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                       str(free_port()), __file__, "--worker", f"{setup}:{int(monitored)}", "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--layers", str(args.layers), "--out", tmp]
                res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
                line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
                if res.returncode != 0 or line is None:
                    print(res.stdout[-2000:], res.stderr[-4000:], file=sys.stderr)
                    return 1
                r = json.loads(line[len("RESULT "):])
                for key in ("times", "cpu"):
                    results[(setup, monitored)][key].extend(r[key])
                results[(setup, monitored)]["losses"].append(r["losses"])
    print(f"small GPT ({args.layers} layers), 2 gloo ranks on CPU ({os.cpu_count()} cores, 1 thread per rank), "
          f"{args.steps} steps x {args.rounds} runs, monitor everything on (csv)")
    print(f"{'setup':8s} {'no monitor':>11s} {'monitor':>10s} {'ratio':>7s} {'cpu ratio':>10s}  losses identical")
    for setup in ("ddp", "fsdp2"):
        off, on = results[(setup, False)], results[(setup, True)]
        base, mon = statistics.median(off["times"]), statistics.median(on["times"])
        cpu = statistics.median(on["cpu"]) / statistics.median(off["cpu"])
        same = all(run == off["losses"][0] for run in off["losses"] + on["losses"])
        print(f"{setup:8s} {base * 1e3:9.1f}ms {mon * 1e3:8.1f}ms {mon / base:6.2f}x {cpu:9.2f}x  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
