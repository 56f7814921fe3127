"""A training process that dies mid-step: ``run_killed_mid_step`` trains ``TinyNet`` for three steps under a
``mix``/``tensor`` dump (or another level and task) and sends itself a signal in step 1, after the backward and before ``stop()`` and
``step()``; the tests then check what was kept and what ``recover`` rebuilds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]

SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {support!r})
    from dump_models import TinyNet
    from msprobe_core.pytorch import PrecisionDebugger
    torch.manual_seed(0)
    model = TinyNet()
    dbg = PrecisionDebugger({{"dump_path": {out!r}, "level": {level!r}, "task": {task!r}}})
    for step in range(3):
        dbg.start(model)
        loss = model(torch.randn(2, 8)).sum()
        loss.backward()
        if step == 1:
            os.kill(os.getpid(), signal.{sig})  # mid-step: after the backward, before stop() and step()
        dbg.stop()
        dbg.step()
""")


def run_killed_mid_step(tmp_path: Path, sig: str = "SIGKILL", level: str = "mix",
                        task: str = "tensor") -> tuple[subprocess.CompletedProcess, Path]:
    """Run the script in a fresh process (cwd ``tmp_path``) that sends itself ``sig`` (a ``signal`` name) in
    step 1; the finished process and its dump path ``tmp_path/dump``."""
    out = tmp_path / "dump"
    script = SCRIPT.format(support=str(SUPPORT), out=str(out), sig=sig, level=level, task=task)
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return proc, out
