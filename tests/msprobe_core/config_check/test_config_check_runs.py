"""config_check end to end: real two-rank DDP trainings (torchrun, gloo) launched by bash scripts, packs
collected by ConfigChecker, compared with ``python -m msprobe_core config_check -c``.

Run B differs from run A in the learning rate and the seed (launch script), a package version (its pip
list edited, as if collected on another machine) and rank 1's data order (an environment variable the
training script reads, invisible in the launch script): each difference shows in its own sheet and no
other check fails. Run A' repeats run A: everything passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import openpyxl
import pytest

from config_check_packs import edit_pip
from dist_run import free_port

ROOT = Path(__file__).resolve().parents[3]
TRAIN = ROOT / "tests" / "support" / "config_check_train.py"

RUN_SH = """#!/bin/bash
# launch script of the {name} run
LR={lr}
SEED={seed}
torchrun --nproc_per_node 2 --master_port ${{MASTER_PORT:-29500}} {train} \\
    --lr $LR --seed=${{SEED}} \\
    --pack config_check_pack.zip --shell-path "$0"
"""


def _run(folder: Path, lr: str, seed: str, reverse_rank: str = "") -> Path:
    folder.mkdir()
    (folder / "run.sh").write_text(RUN_SH.format(name=folder.name, lr=lr, seed=seed, train=TRAIN))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT), "CC_TEST_REVERSE_RANK": reverse_rank}
    res = subprocess.run(["bash", "run.sh"], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return folder / "config_check_pack.zip"


def _compare(tmp_path: Path, a: Path, b: Path, name: str) -> tuple[int, dict[str, list[tuple]]]:
    out = tmp_path / name
    res = subprocess.run([sys.executable, "-m", "msprobe_core", "config_check", "-c", str(a), str(b), "-o", str(out)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode in (0, 1), res.stderr
    wb = openpyxl.load_workbook(out / "result.xlsx")
    return res.returncode, {ws.title: list(ws.iter_rows(values_only=True)) for ws in wb}


def _errors(sheet: list[tuple]) -> list[tuple]:
    level = sheet[0].index("level")
    return [r for r in sheet[1:] if r[level] == "error"]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_runs_differences_land_in_their_sheets(tmp_path):
    a = _run(tmp_path / "a", "1e-4", "1")
    a2 = _run(tmp_path / "a2", "0.0001", "1")
    b = _run(tmp_path / "b", "2e-4", "2", reverse_rank="1")
    edit_pip(b, {"numpy": "1.0.0"})
    with zipfile.ZipFile(a) as zf:
        names = set(zf.namelist())
        assert json.loads(zf.read("pack.json"))["world_size"] == 2
    assert {f"rank{r}/step{s}/{m}" for r in (0, 1) for s in range(3) for m in ("weights.json", "dataset.json")} <= names
    assert {"rank0/random.json", "rank1/random.json", "env.json", "pip.json", "hyperparameters.json"} <= names

    code, sheets = _compare(tmp_path, a, a2, "same")
    assert code == 0
    assert [r[1] for r in sheets["summary"][1:7]] == ["pass"] * 5 + ["info"]
    for check in ("env", "pip", "weights", "dataset", "random"):
        assert sheets[check][1:] == [], check
    assert all(r[5] == "info" for r in sheets["hyperparameters"][1:])  # at most the master port

    code, sheets = _compare(tmp_path, a, b, "diff")
    assert code == 1
    summary = {r[0]: r[1] for r in sheets["summary"][1:7]}
    assert summary == {"env": "pass", "pip": "fail", "hyperparameters": "fail", "weights": "pass", "dataset": "fail",
                       "random": "info"}
    assert {r[0]: r[1:3] for r in _errors(sheets["hyperparameters"])} == {"learning_rate": ("1e-4", "2e-4"),
                                                                          "seed": ("1", "2")}
    assert [r[:3] for r in _errors(sheets["pip"])] == [("numpy", _numpy_version(a), "1.0.0")]
    # rank 1's four batches reversed: micro-steps 0, 1, 2 see other batches; rank 0 is untouched
    assert sorted((r[0], r[1], r[2]) for r in _errors(sheets["dataset"])) == [(1, 0, "args.0"), (1, 1, "args.0"),
                                                                              (1, 2, "args.0")]
    assert _errors(sheets["weights"]) == []  # same initial weights; later steps differ as information
    assert {(r[0], r[1]) for r in sheets["weights"][1:]} == {(0, 1), (0, 2), (1, 1), (1, 2)}
    seeds = [(r[6], r[7]) for r in sheets["random"][1:] if r[2] == "torch.manual_seed" and r[6] != "0"]
    assert sorted(seeds) == [("1", "2"), ("2", "3")]  # seed + rank on ranks 0 and 1


def _numpy_version(pack: Path) -> str:
    with zipfile.ZipFile(pack) as zf:
        return json.loads(zf.read("pip.json"))["packages"]["numpy"]
