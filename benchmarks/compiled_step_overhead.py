"""The tool on a ``torch.compile``d model: step time with the monitor and with the dump, as a ratio to the same
compiled model without the tool (CPU).

Workload: the small GPT of ``benchmarks.small_gpt`` at the size of the issue's measurement (2 layers, hidden
256, 4 heads, sequence 64, batch 8, AdamW), compiled with ``torch.compile(model, backend=--backend)`` (default
``inductor``, torch's default), ``--threads`` torch threads (default 2). Each configuration runs in a fresh
process (a fresh Dynamo cache): ``--warmup`` steps first (they compile, and recompile if the tool made Dynamo
do so), then ``--steps`` timed steps; configurations are interleaved over ``--rounds`` runs so background load
hits them alike. Printed per configuration: median wall-clock and process-CPU step time over no tool, the graph
breaks and graphs Dynamo counted (``torch._dynamo.utils.counters``), whether a recompile limit was hit, and
whether the losses are bit-identical to the first run without the tool (the run-to-run noise of the "none" row
is the CPU backend's own).

Configurations:

    none      the compiled model alone
    monitor   TrainerMon with xy (forward + backward), weight grads, Adam moments and weights on, format csv
              (activation statistics computed inside the graph: no graph break, ``monitor.compiled_hooks``)
    L0        PrecisionDebugger level L0, task statistics: start(model) before the forward, stop(); step() after
              (module records from statistics computed inside the graph: ``pytorch.compiled_records``)
    mix       the same at level mix (L0 records and every API call: Dynamo breaks the graph at each one)

Usage: ``python benchmarks/compiled_step_overhead.py [--configs none,monitor,L0] [--rounds 2] [--steps 8]
[--backend inductor|aot_eager]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIGS = ("none", "monitor", "L0", "mix")
MONITOR = {"xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
           "format": "csv"}


def worker(name: str, steps: int, warmup: int, backend: str, out: str, threads: int) -> dict:
    """Train the compiled small GPT ``warmup + steps`` steps with configuration ``name``."""
    import torch
    from torch._dynamo.utils import counters

    from benchmarks.small_gpt import GPTConfig, build, train

    torch.set_num_threads(threads)
    model, opt, data = build(cfg=GPTConfig(layers=2, seq=64))
    model = torch.compile(model, backend=backend)
    before = after = None
    mon = None
    if name == "monitor":
        from msprobe_core.monitor.trainer_mon import TrainerMon

        path = Path(out) / "monitor.json"
        path.write_text(json.dumps(MONITOR))
        mon = TrainerMon(str(path), output_dir=str(Path(out) / "monitor"))
        mon.set_monitor(model, 1, opt)
    elif name != "none":
        from msprobe_core.pytorch import PrecisionDebugger

        dbg = PrecisionDebugger({"task": "statistics", "level": name, "dump_path": str(Path(out) / name)})
        before = lambda i: dbg.start(model)  # noqa: E731
        after = lambda i: (dbg.stop(), dbg.step())  # noqa: E731
    stamps: list[tuple[float, float]] = []

    def stamp(i: int) -> None:
        if before:
            before(i)
        stamps.append((time.perf_counter(), time.process_time()))

    losses, _ = train(model, opt, data, warmup + steps, stamp, after)
    stamps.append((time.perf_counter(), time.process_time()))
    if mon is not None:
        mon.close()
    timed = stamps[warmup:]
    return {"times": [b[0] - a[0] for a, b in zip(timed, timed[1:])],
            "cpu": [b[1] - a[1] for a, b in zip(timed, timed[1:])], "losses": losses,
            "breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "limit": any("recompile_limit" in str(k) for k in counters["graph_break"])
            or max(counters["recompiles"].values(), default=0) >= torch._dynamo.config.recompile_limit}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (compilation)")
    p.add_argument("--rounds", type=int, default=2, help="runs of every configuration (interleaved)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads (1 on a busy shared machine: OpenMP's spinning threads inflate CPU time there)")
    p.add_argument("--configs", default="none,monitor,L0", help="comma-separated subset of " + ", ".join(CONFIGS))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.warmup, args.backend, args.out, args.threads)))
        return 0

    names = [n for n in args.configs.split(",") if n]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        p.error(f"--configs: {bad} not in {list(CONFIGS)}")
    if "none" not in names:
        names.insert(0, "none")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MSPROBE_LOG_LEVEL": "WARNING",
           "PYTHONPATH": os.pathsep.join(q for q in (str(ROOT), os.environ.get("PYTHONPATH", "")) if q)}
    with tempfile.TemporaryDirectory(prefix="compiled_bench_") as tmp:
        for r in range(args.rounds):
            for name in names:
                out = Path(tmp) / f"{name}{r}"
                out.mkdir()
                cmd = [sys.executable, __file__, "--worker", name, "--steps", str(args.steps), "--warmup",
                       str(args.warmup), "--backend", args.backend, "--threads", str(args.threads), "--out", str(out)]
                res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
                if res.returncode != 0:
                    print(res.stderr, file=sys.stderr)
                    return 1
                runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    base = statistics.median(t for run in runs["none"] for t in run["times"])
    base_cpu = statistics.median(t for run in runs["none"] for t in run["cpu"])
    reference = runs["none"][0]["losses"]
    print(f"small GPT (2 layers, hidden 256, seq 64, batch 8) under torch.compile(backend={args.backend!r}), CPU, "
          f"{args.threads} thread(s), {args.steps} steps after {args.warmup} x {args.rounds} runs")
    print(f"{'configuration':13s} {'median step':>12s} {'ratio':>7s} {'cpu':>7s} {'breaks':>7s} {'graphs':>7s} "
          f"{'limit hit':>9s}  losses identical (max diff)")
    for name in names:
        med = statistics.median(t for run in runs[name] for t in run["times"])
        med_cpu = statistics.median(t for run in runs[name] for t in run["cpu"])
        diff = max(abs(a - b) for run in runs[name] for a, b in zip(run["losses"], reference))
        last = runs[name][-1]
        print(f"{name:13s} {med * 1e3:10.1f}ms {med / base:6.2f}x {med_cpu / base_cpu:6.2f}x {last['breaks']:7d} "
              f"{last['graphs']:7d} {str(any(r['limit'] for r in runs[name])):>9s}  {str(diff == 0.0):5s} ({diff:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
