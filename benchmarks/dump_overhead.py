"""Dump overhead on the small GPT (CPU, 2 threads): ratio of each configuration to no tool.

Each configuration runs in a fresh process: build the model, one warm-up step, then ``--steps`` timed
steps with ``start(model)`` before the forward and ``stop(); step()`` after ``optimizer.step()``. The
per-step time is the median over ``--repeats`` processes' means; the ``cpu`` column is the ratio of the
process CPU time per step (far less sensitive to other jobs on a shared machine). Also measures what importing
``msprobe_core.pytorch`` adds to ``import torch``.

    python benchmarks/dump_overhead.py [--steps 5] [--repeats 3] [--only L1,mix]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import overhead_runner
from overhead_runner import HERE, ROOT

CONFIGS = overhead_runner.CONFIGS
TARGETS = {"idle": 1.01, "L0": 1.2, "L1": 1.8, "mix": 2.0, "L1 md5": 2.2, "L1 tensor": 5.0}

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {here!r})
import torch
torch.set_num_threads(2)
import small_gpt
cfg = {cfg!r}
model, opt, data = small_gpt.build()
before = after = None
if cfg is not None:
    from msprobe_core.pytorch import PrecisionDebugger
    if cfg != "idle":
        level, task, mode = cfg
        dbg = PrecisionDebugger({{"task": task, "dump_path": {out!r}, "level": level,
                                  task: {{"summary_mode": mode}}}})
        before = lambda i: dbg.start(model)
        after = lambda i: (dbg.stop(), dbg.step())
small_gpt.train(model, opt, data, 1, before, after)
c0 = time.process_time()
losses, seconds = small_gpt.train(model, opt, data, {steps}, before, after)
cpu = time.process_time() - c0
print(json.dumps({{"step_s": seconds / {steps}, "cpu_s": cpu / {steps}, "losses": losses}}))
"""


# Disk dumps are removed when the benchmark ends, not between configurations: a file system without a
# journal (ext4 here) scans past every inode freed in the last minutes when it creates a file, so deleting
# one run's thousands of files makes the next run's file creation several times dearer, a cost no real
# training pays.
_DISK_OUTPUTS: list[str] = []


def run_config(name: str, cfg, steps: int) -> dict:
    tmpfs = name.endswith("tmpfs") and os.path.isdir("/dev/shm")
    out = tempfile.mkdtemp(prefix="msprobe_bench_", dir="/dev/shm" if tmpfs else None)
    shutil.rmtree(out)
    try:
        result = overhead_runner.run_child(CHILD.format(here=HERE, cfg=cfg, out=out, steps=steps), MKL_NUM_THREADS="2")
        result["bytes"] = _unique_bytes(out)
        return result
    finally:
        if tmpfs:
            shutil.rmtree(out, ignore_errors=True)
        else:
            _DISK_OUTPUTS.append(out)
        os.sync()  # the next configuration must not pay for this one's disk writeback


def _unique_bytes(root: str) -> int:
    """Bytes on disk under ``root``, counting hard-linked files once."""
    seen, total = set(), 0
    for d, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(d, f))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


def import_cost(repeats: int) -> float:
    def t(stmt: str) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", stmt], check=True, env=dict(os.environ, PYTHONPATH=ROOT))
            times.append(time.perf_counter() - t0)
        return min(times)
    return t("import torch; import msprobe_core.pytorch") - t("import torch")


def _equal_runs(runs: list[list[float]], reference: list[float]) -> str:
    """'True' when every run's losses equal the first unmonitored run's, else which steps differed and by how much."""
    bad = [i for i, run in enumerate(runs) if run != reference]
    if not bad:
        return f"True ({len(runs)})"
    steps = sorted({k for i in bad for k, (a, b) in enumerate(zip(runs[i], reference)) if a != b})
    worst = max(abs(a - b) for i in bad for a, b in zip(runs[i], reference))
    return f"False: runs {bad} of {len(runs)}, steps {steps}, max |diff| {worst:.3g}"


def main() -> None:
    args = overhead_runner.parse_args(__doc__, steps=5)
    names = overhead_runner.selected(CONFIGS, args.only)
    try:
        runs = overhead_runner.interleaved(names, args.repeats, lambda n: run_config(n, CONFIGS[n], args.steps))
    finally:
        for out in _DISK_OUTPUTS:
            shutil.rmtree(out, ignore_errors=True)
    times = {n: [r["step_s"] for r in runs[n]] for n in names}
    cpu = {n: statistics.median(r["cpu_s"] for r in runs[n]) for n in names}
    losses = {n: [r["losses"] for r in runs[n]] for n in names}
    sizes = {n: runs[n][-1]["bytes"] for n in names}
    base = statistics.median(times["none"])
    reference = losses["none"][0]
    print(f"{'config':<16} {'step ms':>8} {'ratio':>6} {'cpu':>6} {'target':>8} {'MB/step':>8}  losses equal (runs)")
    for n in names:
        med = statistics.median(times[n])
        target = TARGETS.get(n)
        print(f"{n:<16} {med * 1e3:8.1f} {med / base:6.2f}x {cpu[n] / cpu['none']:5.2f}x "
              f"{('<= %.2fx' % target) if target else '':>8} "
              f"{sizes[n] / 1e6 / (args.steps + 1):8.1f}  {_equal_runs(losses[n], reference)}")
    print(f"import msprobe_core.pytorch adds {import_cost(args.repeats):.3f} s to import torch (target <= 0.3 s)")


if __name__ == "__main__":
    main()
