"""MindSpore dump overhead on the small transformer of ``ms_small_net`` (CPU, PyNative): ratio of each
configuration to the same training without the tool.

Each configuration runs in a fresh process: build the network, two warm-up steps, then ``--steps`` timed
steps with ``start(net)`` before ``value_and_grad`` and ``stop(); step()`` after the optimizer. A process's
step time is the median of its steps (wall clock, and its CPU time, which other processes on a shared machine
disturb less); a configuration's is the best of ``--repeats`` processes (configurations interleaved, so
background load hits them alike; the best run is the one least disturbed). Ops are launched synchronously (``mindspore.runtime.launch_blocking()``) in every configuration: on a
small shared machine MindSpore's asynchronous launch threads make each op 10-30x slower and noisier, which
would hide the tool's cost rather than show it.

    python benchmarks/mindspore_overhead.py [--steps 10] [--repeats 3] [--only L0,L1]
"""

from __future__ import annotations

import shutil
import tempfile

import overhead_runner
from overhead_runner import HERE

# the dump's configurations but the PyTorch-only ones ("idle": a debugger created, never started)
CONFIGS = {n: c for n, c in overhead_runner.CONFIGS.items() if n not in ("L1 structure", "L1 tensor tmpfs")}
TARGETS = {"L0": 1.3, "L1": 2.0}

CHILD = r"""
import json, statistics, sys
sys.path.insert(0, {here!r})
import mindspore as ms
import ms_small_net
net, opt, grad_fn, batches = ms_small_net.build()
ms.runtime.launch_blocking()
cfg = {cfg!r}
before = after = None
if cfg is not None:
    from msprobe_core.mindspore import PrecisionDebugger
    if cfg == "idle":
        dbg = PrecisionDebugger({{"dump_path": {out!r}, "level": "L1"}})
    else:
        level, task, mode = cfg
        dbg = PrecisionDebugger({{"task": task, "dump_path": {out!r}, "level": level, task: {{"summary_mode": mode}}}})
        before = lambda i: dbg.start(net)
        after = lambda i: (dbg.stop(), dbg.step())
ms_small_net.train(net, opt, grad_fn, batches, 2, before, after)
losses, wall, cpu = ms_small_net.train(net, opt, grad_fn, batches, {steps}, before, after)
print(json.dumps({{"step_s": statistics.median(wall), "cpu_s": statistics.median(cpu), "losses": losses}}))
"""


def run_config(cfg, steps: int) -> dict:
    out = tempfile.mkdtemp(prefix="msprobe_ms_bench_")
    shutil.rmtree(out)
    try:
        return overhead_runner.run_child(CHILD.format(here=HERE, cfg=cfg, out=out, steps=steps), GLOG_v="3")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    args = overhead_runner.parse_args(__doc__, steps=10)
    names = overhead_runner.selected(CONFIGS, args.only)
    runs = overhead_runner.interleaved(names, args.repeats, lambda n: run_config(CONFIGS[n], args.steps))
    times = {n: [r["step_s"] for r in runs[n]] for n in names}
    cpu = {n: [r["cpu_s"] for r in runs[n]] for n in names}
    losses = {n: [r["losses"] for r in runs[n]] for n in names}
    base, cpu_base = min(times["none"]), min(cpu["none"])
    reference = losses["none"][0]
    print(f"{'config':<10} {'step ms':>8} {'ratio':>6} {'CPU ms':>8} {'ratio':>6} {'target':>8}  losses equal to no tool")
    for n in names:
        med, cpu_med = min(times[n]), min(cpu[n])
        target = TARGETS.get(n)
        print(f"{n:<10} {med * 1e3:8.1f} {med / base:6.2f}x {cpu_med * 1e3:8.1f} {cpu_med / cpu_base:6.2f}x "
              f"{('<= %.1fx' % target) if target else '':>8}  {all(run == reference for run in losses[n])}")


if __name__ == "__main__":
    main()
