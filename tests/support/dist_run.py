"""Multi-process test jobs: ``run_two_ranks`` launches a script as two gloo ranks under
``python -m torch.distributed.run``; the child scripts end the documented way: close msprobe, ``del`` the
framework wrappers (DDP module, engine, trainer), then ``msprobe_core.session.finish_distributed()``.

The children get ``PYTHONPATH`` = the repository root and ``tests/support`` (so ``from dist_run import
the other support modules import by name) and ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional, Union

import pytest

from msprobe_core.common.ports import free_port  # noqa: F401  (the tests import it from here)

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc)."""
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


def torchrun(script: Union[str, os.PathLike], *args: str, nproc: int = 2, timeout: float = 300,
             cwd: Union[str, os.PathLike, None] = None, env: Optional[dict] = None) -> str:
    """Run ``script args`` as ``nproc`` processes under ``torch.distributed.run`` on a free port; its stdout.

    Fails the test with the output's tail when the job fails, and kills every process of the job when it
    runs past ``timeout`` seconds (a rank waiting for the other in a collective). ``env`` adds to the
    environment."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), os.fspath(script), *args]
    path = os.pathsep.join([str(ROOT), str(SUPPORT)])
    full_env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(proc.pid), proc.pid]:  # torchrun starts each worker in a session of its own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate()
        pytest.fail(f"the {nproc} ranks did not finish within {timeout} s (one waits for another?)\n"
                    f"{out[-2000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    assert "still alive at finish_distributed" not in err, f"a framework wrapper was not released\n{err[-3000:]}"
    return out


def run_two_ranks(script_text: str, tmp_path: Path, *args: str, timeout: float = 300,
                  env: Optional[dict] = None, name: str = "train.py") -> str:
    """Write ``script_text`` to ``tmp_path/name`` and run it as two gloo ranks (see ``torchrun``); its stdout.
    The script reads its rank from the environment (``dist.init_process_group("gloo")``)."""
    script = tmp_path / name
    script.write_text(script_text)
    return torchrun(script, *args, nproc=2, timeout=timeout, env=env)
