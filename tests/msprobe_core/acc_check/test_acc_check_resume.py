"""acc_check killed with SIGKILL and resumed with -csv_path, and multi_acc_check, as real processes."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from acc_check_dumps import dump_step, gpt_step
from msprobe_core.acc_check.api_calls import load_dump
from small_gpt import GPTConfig

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
CFG = GPTConfig(vocab=128, layers=4, hidden=64, heads=4, seq=16, batch=4)


@pytest.fixture(scope="module")
def dump_json(tmp_path_factory) -> Path:
    return dump_step(tmp_path_factory.mktemp("acc_resume") / "dump", "statistics", gpt_step(CFG))


@pytest.fixture(scope="module")
def full_run(dump_json, tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted acc_check run: its folder and its stderr."""
    out = tmp_path_factory.mktemp("acc_full")
    return out, _run("acc_check", "-api_info", str(dump_json), "-o", str(out)).stderr


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "msprobe_core", *args]


def _run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))[1:]


def _pair(folder: Path) -> tuple[Path, Path]:
    (result,) = folder.glob("accuracy_checking_result_*.csv")
    return result, result.with_name(result.name.replace("_result_", "_details_"))


def test_killed_run_resumes_to_the_same_csv_files(dump_json, full_run, tmp_path):
    total = len(load_dump(dump_json).calls)
    assert f"acc_check: {total}/{total} APIs (100%)" in full_run[1]  # plain progress lines off a terminal
    full_result, full_details = _pair(full_run[0])

    killed_dir = tmp_path / "killed"
    proc = subprocess.Popen(_cmd("acc_check", "-api_info", str(dump_json), "-o", str(killed_dir)), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    rows_at_kill = 0
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(killed_dir.glob("accuracy_checking_result_*.csv"))
            if found:
                rows_at_kill = found[0].read_bytes().count(b"\n") - 1
                if rows_at_kill >= 5:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            time.sleep(0.002)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    killed_result, killed_details = _pair(killed_dir)
    assert 5 <= len(_rows(killed_result)) < total

    resumed = _run("acc_check", "-api_info", str(dump_json), "-csv_path", str(killed_result))
    assert "were done before (resumed)" in resumed.stdout
    assert _pair(killed_dir) == (killed_result, killed_details)  # appended, no new files
    assert killed_result.read_text() == full_result.read_text()
    assert killed_details.read_text() == full_details.read_text()


def test_multi_acc_check_splits_the_calls_over_workers(dump_json, full_run, tmp_path):
    names = [c.name for c in load_dump(dump_json).calls]
    single_result, single_details = _pair(full_run[0])
    assert "error" not in single_result.read_text()
    statuses = {r[0]: r[1:3] for r in _rows(single_result)}

    out = tmp_path / "multi"
    proc = _run("multi_acc_check", "-api_info", str(dump_json), "-d", "0", "1", "-o", str(out))
    assert "2 workers checked" in proc.stdout
    folders = sorted(out.iterdir())
    assert [f.name.split("_")[0] for f in folders] == ["device0", "device1"]
    assert folders[0].name.split("_", 1)[1] == folders[1].name.split("_", 1)[1]  # one timestamp per run
    per_worker = [[r[0] for r in _rows(_pair(f)[0])] for f in folders]
    assert all(per_worker), "both workers checked calls"
    assert sorted(per_worker[0] + per_worker[1]) == sorted(names)  # each call once
    multi_statuses = {r[0]: r[1:3] for f in folders for r in _rows(_pair(f)[0])}
    assert multi_statuses == statuses
    details = sorted(r[0] for f in folders for r in _rows(_pair(f)[1]))
    assert details == sorted(r[0] for r in _rows(single_details))

    # resuming a finished multi run checks nothing; a second run gets its own folders
    before = {f: _pair(f)[0].read_text() for f in folders}
    _run("multi_acc_check", "-api_info", str(dump_json), "-d", "0", "1", "-csv_path", str(_pair(folders[1])[0]))
    assert {f: _pair(f)[0].read_text() for f in folders} == before
    _run("multi_acc_check", "-api_info", str(dump_json), "-d", "0", "-o", str(out))
    assert len(list(out.iterdir())) == 3
