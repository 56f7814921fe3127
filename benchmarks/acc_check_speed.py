"""acc_check speed: replay a ~600-record L1 dump of the small GPT (12 layers) in bfloat16 autocast.

One training step (forward + backward, loss in float32) is dumped at L1 (task statistics, or tensor with
``--task tensor``) in a fresh process. Then, each in a fresh process pinned to ``--cpus`` CPUs,
``--repeats`` times: ``acc_check``, ``multi_acc_check -d 0`` (one worker) and ``multi_acc_check -d 0 1``
(two workers), interleaved round by round. Reported: median and minimum wall seconds, CPU seconds, the
speed-up of two workers over one (median of the rounds' ratios, and the ratio of the minima: the runs the
load disturbed least) and the load average before each run (the machine may be shared). Targets: acc_check
under 60 s on 2 CPUs; two workers at least 1.7x faster than one. Every run must find no failing API (the
model is healthy).

    python benchmarks/acc_check_speed.py [--repeats 3] [--cpus 2] [--layers 12] [--task statistics] [--keep DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from compare_speed import _pin

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGET_S = 60.0
TARGET_SPEEDUP = 1.7

DUMP_CHILD = r"""
import sys
sys.path.insert(0, {here!r})
import torch
import torch.nn.functional as F
torch.set_num_threads(2)
import small_gpt
from msprobe_core.pytorch import PrecisionDebugger
model, opt, data = small_gpt.build(0, small_gpt.GPTConfig(layers={layers}))
batch = data[0]
dbg = PrecisionDebugger(dump_path={out!r}, level="L1", task={task!r})
dbg.start()
with torch.autocast("cpu", dtype=torch.bfloat16):
    logits = model(batch[:, :-1])
F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()
dbg.stop()
dbg.step()
"""


def dump(out: str, layers: int, task: str) -> str:
    """Dump one bf16-autocast training step of the small GPT in a fresh process; the dump.json path."""
    code = DUMP_CHILD.format(here=HERE, layers=layers, out=out, task=task)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    (found,) = glob.glob(os.path.join(out, "step0", "*", "dump.json"))
    return found


def time_run(args: list[str], out: str, cpus: int) -> tuple[float, float, str, float]:
    """One ``python -m msprobe_core ...`` run: wall seconds, the CPU seconds it reports (of the process that
    checked, or the sum over the workers), its stdout, and the 1-minute load average before it."""
    shutil.rmtree(out, ignore_errors=True)
    preexec, _ = _pin(cpus)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "msprobe_core", *args, "-o", out], cwd=ROOT, capture_output=True,
                          text=True, preexec_fn=preexec)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{args[0]} failed ({proc.returncode}): {proc.stderr}")
    cpu = re.search(r"CPU time ([\d.+ ]+) s", proc.stdout)
    return seconds, sum(float(x) for x in cpu.group(1).split("+")) if cpu else math.nan, proc.stdout, load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs the runs may use")
    parser.add_argument("--layers", type=int, default=12, help="GPT layers (12: about 620 records)")
    parser.add_argument("--task", choices=("statistics", "tensor"), default="statistics")
    parser.add_argument("--keep", default=None, help="keep the dump in this folder (reused when present)")
    args = parser.parse_args()

    root = args.keep or tempfile.mkdtemp(prefix="acc_check_speed_")
    dump_dir = os.path.join(root, f"dump_{args.task}_{args.layers}")
    found = glob.glob(os.path.join(dump_dir, "step0", "*", "dump.json"))
    dump_json = found[0] if found else dump(dump_dir, args.layers, args.task)
    with open(dump_json, encoding="utf-8") as f:
        data = json.load(f)["data"]
    records, apis = len(data), sum(name.endswith(".forward") for name in data)
    _, cpus = _pin(args.cpus)
    print(f"small GPT, {args.layers} layers, one bf16-autocast step dumped at L1 (task {args.task}): {records} "
          f"records, {apis} API calls; {cpus} CPUs, {os.cpu_count()} on the machine")
    configs = {"acc_check": ["acc_check"], "multi_1_worker": ["multi_acc_check", "-d", "0"],
               "multi_2_workers": ["multi_acc_check", "-d", "0", "1"]}
    runs: dict = {name: {"wall_s": [], "cpu_s": [], "load_before": []} for name in configs}
    ok = True
    try:
        for _ in range(args.repeats):  # one round runs every configuration: the load moves less within it
            for name, cmd in configs.items():
                seconds, cpu, stdout, load = time_run([*cmd, "-api_info", dump_json], os.path.join(root, f"out_{name}"),
                                                      args.cpus)
                for key, value in (("wall_s", seconds), ("cpu_s", cpu), ("load_before", load)):
                    runs[name][key].append(round(value, 2))
                if "failing APIs" in stdout or " 0 error" not in stdout:
                    ok = False
                    print(f"  {name}: unexpected failing APIs:\n{stdout}", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    results = {name: {"median_s": statistics.median(r["wall_s"]), "min_s": min(r["wall_s"]), **r}
               for name, r in runs.items()}
    for name, r in results.items():
        print(f"  {name:>16}: {r['median_s']:6.2f} s median wall, {r['min_s']:.2f} s min "
              f"(runs {', '.join(map(str, r['wall_s']))}; CPU s "
              f"{', '.join(map(str, r['cpu_s']))}; 1-min load before: {', '.join(map(str, r['load_before']))})")
    ratios = [one / two for one, two in zip(runs["multi_1_worker"]["wall_s"], runs["multi_2_workers"]["wall_s"])]
    speedup = statistics.median(ratios)
    best = results["multi_1_worker"]["min_s"] / results["multi_2_workers"]["min_s"]
    print(f"  two workers vs one: {speedup:.2f}x median of the rounds ({', '.join(f'{r:.2f}' for r in ratios)}), "
          f"{best:.2f}x of the minima (target >= {TARGET_SPEEDUP}x); "
          f"acc_check {results['acc_check']['median_s']:.1f} s "
          f"(target < {TARGET_S:.0f} s)")
    print(json.dumps({"benchmark": "acc_check_speed", "records": records, "api_calls": apis, "cpus": cpus,
                      "task": args.task, **results, "speedup_2_workers": round(speedup, 2),
                      "speedup_of_minima": round(best, 2)}))
    ok = ok and results["acc_check"]["median_s"] < TARGET_S and speedup >= TARGET_SPEEDUP
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
