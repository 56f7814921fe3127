"""Runs of a dump script in a fresh process, for the tests that compare two routes of the same records (the C
fast routes against the Python ones) and a process killed mid-step against one that was not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parents[2]
FILES = ("dump.json", "stack.json", "construct.json")


def run_script(script: str, out: Path) -> subprocess.CompletedProcess:
    """``python -c script`` with this checkout importable, run beside the dump path ``out``."""
    return subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600, cwd=out.parent)


def run_each(tmp_path: Path, routes: Iterable[Any], run: Callable[[Path, Any], subprocess.CompletedProcess]
             ) -> dict[Any, Path]:
    """``run(dump path, route)`` for each route, into ``tmp_path/<route>/dump``, each ending with exit 0; the
    dump paths by route."""
    outs = {}
    for route in routes:
        out = tmp_path / str(route) / "dump"
        out.parent.mkdir()
        proc = run(out, route)
        assert proc.returncode == 0, proc.stderr
        outs[route] = out
    return outs


def step_dir(out: Path, step: int) -> Path:
    """The rank folder of ``step`` in the dump path ``out`` (one process)."""
    return next((out / f"step{step}").iterdir())


def assert_same_files(a: Path, b: Path, context: Any) -> None:
    """dump.json, stack.json and construct.json of rank folders ``a`` and ``b`` byte-identical."""
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), (context, name)


def recovered_step(killed: subprocess.CompletedProcess, killed_out: Path, full: subprocess.CompletedProcess,
                   full_out: Path, step: int) -> tuple[dict, Path, Path]:
    """After a run ``killed`` by SIGKILL in ``step`` and a ``full`` run of the same script: ``python -m
    msprobe_core recover`` on the killed run's dump, its dump.json checked equal to the full run's (but for
    ``"recovered"``) and its construct.json too; returns that dump.json and both rank folders (recovered, full)."""
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert full.returncode == 0, full.stderr
    res = subprocess.run([sys.executable, "-m", "msprobe_core", "recover", str(killed_out)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr
    got, want = step_dir(killed_out, step), step_dir(full_out, step)
    recovered = json.loads((got / "dump.json").read_text())
    assert recovered.pop("recovered") is True
    assert recovered == json.loads((want / "dump.json").read_text())
    assert json.loads((got / "construct.json").read_text()) == json.loads((want / "construct.json").read_text())
    return recovered, got, want
