"""Megatron's distributed optimizer with ``module_ranks`` naming part of the data-parallel group: two gloo
ranks run ``recipes/megatron_core_gpt.py`` with ``--use-distributed-optimizer`` and ``module_ranks: [0]``.

Rank 1 monitors nothing but holds half of every gradient, weight and moment shard: it must still take part
in the statistics all-reduces (``msprobe_core.monitor.shard_agreement``), or rank 0 waits for it forever
(before the agreement moved into the core, this run never finished its first iteration). Rank 0's
statistics are those of the full tensors: the same as when every rank monitors; rank 1 writes nothing."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[3]
MONITOR = {"targets": {}, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
           "ops": ["min", "max", "norm", "mean", "nans"], "format": ["csv"]}
TIMEOUT = 240


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK", "MONITOR_OUTPUT_DIR")}
    env.update(PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             port, "recipes/megatron_core_gpt.py", "--train-iters", "2", "--use-distributed-optimizer",
                             *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(proc.pid), proc.pid]:  # torchrun's workers have sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()
        pytest.fail(f"the two ranks did not finish within {TIMEOUT} s: a rank waits for the other in the "
                    "monitor's statistics all-reduce")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run(tmp_path: Path, name: str, config: dict) -> tuple[Path, list[str]]:
    cfg = tmp_path / f"{name}.json"
    cfg.write_text(json.dumps(config))
    out = tmp_path / name
    res = _torchrun(["--msprobe-monitor-config", str(cfg), "--msprobe-monitor-output-dir", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [line.split("lm loss:")[1].split("|")[0].strip() for line in res.stdout.splitlines() if "lm loss:" in line]
    return out, losses


def _rows(path: Path) -> dict[str, dict[str, str]]:
    return {r["name"]: r for r in csv.DictReader(open(path))}


@pytest.mark.slow
@pytest.mark.distributed
def test_module_ranks_naming_part_of_the_data_parallel_group_does_not_hang(tmp_path):
    every, every_losses = _run(tmp_path, "every_rank", MONITOR)
    part, part_losses = _run(tmp_path, "rank0_only", dict(MONITOR, module_ranks=[0]))
    assert part_losses == every_losses and len(part_losses) == 2
    assert not (part / "rank1").exists()
    for step in (1, 2):
        for kind in ("grad", "param", "exp_avg", "exp_avg_sq"):
            name = f"{kind}_{step}-{step}.csv"
            assert _rows(part / "rank0" / name) == _rows(every / "rank0" / name), name
