"""SGLang-style data-parallel inference (seed 003, ``rank_id``): every DP worker is its own one-process
``torch.distributed`` cluster, so ``get_rank()`` is 0 everywhere. Two real processes share one dump_path:
with distinct ``rank_id`` each gets its own rank folder and nothing is overwritten; without it the second
process is refused rather than allowed to overwrite the first one's dump."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from msprobe_core.pytorch import PrecisionDebugger
from msprobe_core.session import finish_distributed

dump_path, gpu_id, init_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
use_rank_id, first_token = sys.argv[4] == "1", int(sys.argv[5])
torch.set_num_threads(1)
# an SGLang DP worker: a cluster of its own, so get_rank() is 0 in every worker
dist.init_process_group("gloo", init_method="file://" + init_file, rank=0, world_size=1)
assert dist.get_rank() == 0
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 50)).eval()
debugger = PrecisionDebugger({"task": "statistics", "dump_path": dump_path, "level": "L0"})
debugger.start(model=model, token_range=[0, 1], rank_id=gpu_id if use_rank_id else None)   # like self.gpu_id in SGLang
tokens = torch.tensor([[first_token]])
with torch.no_grad():
    for _ in range(4):          # prefill + 3 decode steps
        tokens = model(tokens)[:, -1:].argmax(-1)
debugger.stop()
debugger.step()
finish_distributed()
print(json.dumps({"pid": os.getpid()}))
"""


def launch(tmp_path: Path, dump_path: Path, gpu_id: int, use_rank_id: bool, first_token: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), MSPROBE_LOG_LEVEL="WARNING")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    init_file = tmp_path / f"pg_{gpu_id}_{first_token}"
    return subprocess.Popen([sys.executable, "-c", WORKER, str(dump_path), str(gpu_id), str(init_file),
                             "1" if use_rank_id else "0", str(first_token)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def prefill_token(rank_dir: Path) -> float:
    data = json.loads((rank_dir / "dump.json").read_text())["data"]
    assert sorted(k for k in data if k.startswith("Module.0.Embedding")) == \
        ["Module.0.Embedding.forward.0", "Module.0.Embedding.forward.1"]
    return data["Module.0.Embedding.forward.0"]["input_args"][0]["Max"]


def test_same_rank_processes_with_distinct_rank_id_get_their_own_folders(tmp_path):
    dump_path = tmp_path / "dump"
    procs = [launch(tmp_path, dump_path, gpu_id, True, first_token) for gpu_id, first_token in ((0, 5), (1, 7))]
    results = [finish(p) for p in procs]  # both ran at the same time, into the same dump_path
    for rc, out, err in results:
        assert rc == 0, err
    assert sorted(p.name for p in (dump_path / "step0").iterdir()) == ["rank0", "rank1"]
    # each folder holds its own process's data: the prompt token of worker gpu_id 0 is 5, of gpu_id 1 is 7
    assert prefill_token(dump_path / "step0" / "rank0") == 5.0
    assert prefill_token(dump_path / "step0" / "rank1") == 7.0


def test_same_rank_without_rank_id_is_refused_not_overwritten(tmp_path):
    dump_path = tmp_path / "dump"
    rc, _, err = finish(launch(tmp_path, dump_path, 0, False, 5))
    assert rc == 0, err
    first = (dump_path / "step0" / "rank0" / "dump.json").read_bytes()
    rc, _, err = finish(launch(tmp_path, dump_path, 1, False, 7))  # also get_rank() == 0
    assert rc != 0
    assert "DumpPathError" in err and "already holds a dump for rank0" in err
    assert (dump_path / "step0" / "rank0" / "dump.json").read_bytes() == first
    assert sorted(p.name for p in (dump_path / "step0").iterdir()) == ["rank0"]
