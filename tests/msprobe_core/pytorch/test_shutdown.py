"""A closed toolkit keeps nothing of the run alive: after ``close()`` (or ``finish_distributed()``, which
closes what is still open) no reference to the model, the DDP module and its reducer, the optimizer or the
process group is left in msprobe, and no thread or process of msprobe's outlives it. A DDP reducer or a
gloo group alive at interpreter exit can abort the process ("terminate called without an active
exception"), so this is what lets a script that releases its own wrappers exit 0.

Each case runs in a child process of its own (a gloo group of one, a DDP module): the pytest process
never holds a process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

CHILD = textwrap.dedent("""
    import gc, json, os, sys, threading, weakref
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from msprobe_core.session import ProbeSession, finish_distributed
    from msprobe_core.monitor.trainer_mon import TrainerMon

    tmp, how, task = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    group = dist.new_group([0])
    monitor = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
               "xy_distribution": True, "ops": ["min", "max", "norm"], "format": ["api", "csv", "tensorboard"]}
    dump = {"task": task, "level": "L1", "dump_path": f"{tmp}/dump", "async_dump": task == "tensor"}

    def children():  # this process's live child processes (a dump writer, ...), from /proc
        found = []
        for stat in __import__("glob").glob("/proc/[0-9]*/stat"):
            try:
                fields = open(stat).read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                found.append(int(stat.split("/")[2]))
        return found

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    ddp = DDP(model, process_group=group)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.1)
    session = ProbeSession(dump, monitor, monitor_output_dir=f"{tmp}/mon")
    session.attach(ddp, opt, dp_group=group)
    own_monitor = TrainerMon(monitor, output_dir=f"{tmp}/mon2")   # the msprobe way: never closed by the user
    own_monitor.set_monitor(ddp, 1, opt, dp_group=group)
    for step in (0, 1):
        session.begin_step(step)
        opt.zero_grad()
        ddp(torch.ones(2, 4)).pow(2).mean().backward()
        session.before_optimizer_step()
        opt.step()
        session.after_optimizer_step(step)
        session.end_step()
    refs = {"model": weakref.ref(model), "ddp": weakref.ref(ddp), "optimizer": weakref.ref(opt),
            "group": weakref.ref(group)}
    if how == "close":
        session.close()
        own_monitor.close()
    del model, ddp, opt, group
    if how == "close":
        gc.collect()
        alive_after_close = sorted(k for k, r in refs.items() if k != "group" and r() is not None)
    else:
        alive_after_close = None
    finish_distributed()
    print("RESULT " + json.dumps({
        "alive_after_close": alive_after_close,
        "alive": sorted(k for k, r in refs.items() if r() is not None),
        "threads": sorted(t.name for t in threading.enumerate()),
        "children": children(),
        "session_model": session.model is not None, "dump_files": len(list(__import__("pathlib").Path(tmp, "dump").rglob("dump.json")))}))
""")


def _run(tmp_path: Path, how: str, task: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), how, task], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "still alive" not in proc.stderr, proc.stderr[-2000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_close_lets_go_of_model_ddp_optimizer_and_group(tmp_path, task):
    result = _run(tmp_path, "close", task)
    assert result["alive_after_close"] == []   # closed: released by the script's own del and a collection
    assert result["alive"] == []               # the group too, once destroyed
    assert result["threads"] == ["MainThread"] and result["children"] == []  # no writer thread or process left
    assert not result["session_model"] and result["dump_files"] == 2


@pytest.mark.slow
def test_finish_distributed_closes_what_msprobe_left_open(tmp_path):
    """Neither the session nor the monitor is closed by the script: ``finish_distributed`` closes them
    (their files are complete) before it collects, so the released DDP module is gone before the group."""
    result = _run(tmp_path, "finish", "statistics")
    assert result["alive"] == []
    assert result["threads"] == ["MainThread"] and result["children"] == []
    assert not result["session_model"] and result["dump_files"] == 2
