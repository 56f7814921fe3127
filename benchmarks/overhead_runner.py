"""What the dump-overhead benchmarks (``dump_overhead.py``, ``mindspore_overhead.py``) share: the table of
configurations, the command line, and the runs, each in a fresh process, configurations interleaved."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name -> (level, task, summary_mode); None = the tool is not imported; "idle" = set up, never started
CONFIGS = {
    "none": None,
    "idle": "idle",
    "L0": ("L0", "statistics", "statistics"),
    "L1": ("L1", "statistics", "statistics"),
    "L1 structure": ("L1", "structure", "statistics"),  # hooks and records without statistics: the Python share
    "mix": ("mix", "statistics", "statistics"),
    "L1 md5": ("L1", "statistics", "md5"),
    "L1 tensor": ("L1", "tensor", "statistics"),
    # the same with dump_path in /dev/shm: no device, but the writer's page-cache copy and page allocation cost
    # CPU that competes with training on a small machine (a local disk takes O_DIRECT writes: less CPU)
    "L1 tensor tmpfs": ("L1", "tensor", "statistics"),
}


def parse_args(doc: str, steps: int) -> argparse.Namespace:
    """``--steps`` (default ``steps``), ``--repeats``, ``--only``; ``--help`` shows ``doc``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated configurations (default: all)")
    return ap.parse_args()


def selected(configs: dict, only: str) -> list[str]:
    """The configurations ``--only`` names, in table order, always with ``none`` (the baseline)."""
    return [n for n in configs if not only or n in only.split(",") or n == "none"]


def run_child(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter (2 threads, the toolkit's log quiet, the repository on
    ``PYTHONPATH``, ``env`` added); the JSON its last line of output holds."""
    full = dict(os.environ, OMP_NUM_THREADS="2", MSPROBE_LOG_LEVEL="WARNING",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def interleaved(names: list[str], repeats: int, run: Callable[[str], dict]) -> dict[str, list[dict]]:
    """``run(name)`` ``repeats`` times for each configuration, the configurations interleaved so that background
    load hits all of them alike; each configuration's results in run order."""
    results: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(repeats):
        for n in names:
            results[n].append(run(n))
    return results
