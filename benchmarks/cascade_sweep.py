"""The x50 weight fault without weight statistics, over the model zoo, seeds and fault steps.

Issue 28's measure of the cascade rule: ``param_distribution`` off (activations, gradients, optimizer
state on; msprobe's default rule, ``AnomalyTurbulence`` threshold 0.5), each workload's target weight
multiplied by 50 at each of ``--steps`` (after warm-up) of a fresh run. A run is caught when its first
alert at or after the fault's step is at that step and names the faulty parameter or its module; every
alert before the fault is a false alert. Also runs the healthy zoo with ``param_distribution`` off.

Usage: ``python benchmarks/cascade_sweep.py [--seeds 0,1,2] [--steps 9,12,16,24] [--workloads tiny_gpt]``
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from alert_models import MONITOR_CONFIG, WORKLOADS  # noqa: E402
from monitor_alerts import fault_run, healthy_run  # noqa: E402

NO_WEIGHT_STATS = dict(MONITOR_CONFIG, param_distribution=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", default="9,12,16,24", help="fault steps")
    p.add_argument("--healthy", action="store_true", help="also run each workload and seed healthy (40 steps)")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("msprobe_core").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    names = [n for n in args.workloads.split(",") if n]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    steps = [int(s) for s in args.steps.split(",") if s]
    caught = total = false = 0
    missed: list[str] = []
    t0 = time.perf_counter()
    for seed in seeds:
        for name in names:
            row = []
            if args.healthy:
                h = healthy_run(name, seed, config=NO_WEIGHT_STATS)
                false += len(h.false_alerts)
                row.append(f"healthy:{len(h.false_alerts)}")
                for line in h.false_alerts:
                    print(f"    false alert: {line}")
            for step in steps:
                r = fault_run(name, "weight_x50", seed, step, config=NO_WEIGHT_STATS)
                total += 1
                ok = r.caught and r.early_alerts == 0
                caught += ok
                row.append(f"{step}:{'ok' if ok else 'MISSED'}({r.events})")
                if not ok:
                    missed.append(f"{name} seed {seed} step {step}: first {r.first}; early {r.early_alerts}")
            print(f"{name:<18} {seed:>4}  {' '.join(row)}", flush=True)
    for line in missed:
        print("  missed:", line)
    print(f"x50 weight caught at its step naming its module, param_distribution off: {caught}/{total}"
          + (f"; false alerts on healthy runs: {false}" if args.healthy else "")
          + f" ({time.perf_counter() - t0:.0f} s)")
    return 0 if caught == total and false == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
