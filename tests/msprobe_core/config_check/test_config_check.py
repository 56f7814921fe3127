"""config_check: launch-script parsing, value matching, static packs, pack comparison, and the dynamic
ConfigChecker in one process (weights, batches, random call sites; training unchanged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import openpyxl
import pytest
import torch

from config_check_packs import edit_pip
from msprobe_core.cli import main as cli_main
from msprobe_core.config_check import ConfigChecker, pack
from msprobe_core.config_check.checks import overall_pass
from msprobe_core.config_check.compare import compare_packs
from msprobe_core.config_check.config_files import flatten
from msprobe_core.config_check.exceptions import PackInputError, PackPathError
from msprobe_core.config_check.random_patch import patched, remove_patches
from msprobe_core.config_check.shell_script import parse_script
from msprobe_core.config_check.values import canonical_name, same_value
from msprobe_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]

MEGATRON_SCRIPT = r"""#!/bin/bash
# a Megatron-style launch script
export CUDA_DEVICE_MAX_CONNECTIONS=1
export WANDB_API_KEY=s3cr3t
GPUS_PER_NODE=8
NNODES=${NNODES:-2}
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))
MASTER_ADDR=$(hostname -I | awk '{print $1}')
LR=1e-4
CKPT="/data/ckpt"   # where to save

DISTRIBUTED_ARGS="
    --nproc_per_node $GPUS_PER_NODE \
    --nnodes $NNODES \
    --master_addr $MASTER_ADDR \
    --master_port 6000
"
GPT_ARGS=(
    --num-layers 24   # layers
    --hidden-size 1024
    --lr ${LR}
    --min-lr=1e-5
    --adam-beta1 0.9 --adam-beta2 0.95
    --bf16
)
cat > /tmp/ignored.txt <<EOT
--lr 5 is a here-document, not an argument
EOT
torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \
    "${GPT_ARGS[@]}" \
    --seed 1234 --save $CKPT \
    --data-path "my data/path" \
    --world $WORLD_SIZE \
    --undefined $NOPE 2>&1 | tee log.txt
"""


def _one_command(tmp_path, text, env=None):
    script = tmp_path / "run.sh"
    script.write_text(text)
    result = parse_script(script, env=env or {})
    assert len(result.commands) == 1, result.commands
    return result, result.commands[0]


# ================================================================================ launch scripts
def test_megatron_style_script_variables_arrays_continuations(tmp_path):
    result, cmd = _one_command(tmp_path, MEGATRON_SCRIPT)
    assert (cmd.launcher, cmd.entry, cmd.line) == ("torchrun", "pretrain_gpt.py", 29)
    assert cmd.args == {"num_layers": "24", "hidden_size": "1024", "lr": "1e-4", "min_lr": "1e-5", "adam_beta1": "0.9",
                        "adam_beta2": "0.95", "bf16": True, "seed": "1234", "save": "/data/ckpt",
                        "data_path": "my data/path", "world": "16", "undefined": "$NOPE"}
    assert cmd.launcher_args == {"nproc_per_node": "8", "nnodes": "2", "master_addr": "$(hostname...)",
                                 "master_port": "6000"}
    assert result.exported == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "WANDB_API_KEY": "<redacted>"}
    reasons = [(i["line"], i["reason"]) for i in result.issues]
    assert any(line == 8 and "command substitution" in r for line, r in reasons)
    assert any(line == 29 and "$NOPE is not set" in r for line, r in reasons)
    assert len(reasons) == 2  # the here-document and the comment are not issues


def test_environment_fills_variables_the_script_does_not_set(tmp_path):
    _, cmd = _one_command(tmp_path, MEGATRON_SCRIPT, env={"NNODES": "4", "NOPE": "x"})
    assert (cmd.launcher_args["nnodes"], cmd.args["world"], cmd.args["undefined"]) == ("4", "32", "x")


@pytest.mark.parametrize("line, launcher, entry, args, launcher_args", [
    ("python -m torch.distributed.launch --nproc_per_node=2 --use_env train.py --learning_rate=$LR --fp16",
     "torch.distributed.launch", "train.py", {"learning_rate": "2e-4", "fp16": True},
     {"nproc_per_node": "2", "use_env": True}),
    ("deepspeed --num_gpus 2 train_ds.py --deepspeed ds.json --lr $LR", "deepspeed", "train_ds.py",
     {"deepspeed": "ds.json", "lr": "2e-4"}, {"num_gpus": "2"}),
    ("accelerate launch --multi_gpu --num_processes 2 train.py --lr ${LR} --gradient-checkpointing",
     "accelerate launch", "train.py", {"lr": "2e-4", "gradient_checkpointing": True},
     {"multi_gpu": True, "num_processes": "2"}),
    ("msrun --worker_num=8 --local_worker_num=8 --join=True run_mindformer.py --config cfg.yaml", "msrun",
     "run_mindformer.py", {"config": "cfg.yaml"}, {"worker_num": "8", "local_worker_num": "8", "join": "True"}),
    ("CUDA_VISIBLE_DEVICES=0 nohup python3 -u train.py --lr $LR --betas 0.9 0.95 --eps -1e-8 > log 2>&1 &",
     "python", "train.py", {"lr": "2e-4", "betas": ["0.9", "0.95"], "eps": "-1e-8"}, {}),
    ("mpirun -np 8 -x NCCL_DEBUG python train.py --lr=$LR", "mpirun python", "train.py", {"lr": "2e-4"},
     {"np": "8", "x": "NCCL_DEBUG"}),
    ("torchrun --standalone --nproc-per-node 4 -m pkg.train --lr $LR", "torchrun", "pkg.train", {"lr": "2e-4"},
     {"standalone": True, "nproc_per_node": "4"}),
])
def test_launchers(tmp_path, line, launcher, entry, args, launcher_args):
    _, cmd = _one_command(tmp_path, f"LR=2e-4; SEED=42\n{line}\n")
    assert (cmd.launcher, cmd.entry, cmd.args, cmd.launcher_args) == (launcher, entry, args, launcher_args)


def test_unparseable_lines_are_reported_not_raised(tmp_path):
    script = tmp_path / "bad.sh"
    script.write_text('for i in 1 2; do echo $i; done\nsource missing.sh\necho "unterminated\n')
    result = parse_script(script, env={})
    reasons = " | ".join(i["reason"] for i in result.issues)
    assert "loop" in reasons and "missing.sh" in reasons and "unterminated" in reasons
    assert result.commands == []


def test_sourced_files_and_config_files_named_by_arguments(tmp_path):
    (tmp_path / "env.sh").write_text("export LR=3e-4\nMBS=4\n")
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}')
    script = tmp_path / "run.sh"
    script.write_text("source ./env.sh\ndeepspeed train.py --deepspeed ds.json --lr $LR --micro-batch-size $MBS\n")
    result = parse_script(script, env={})
    assert result.commands[0].args == {"deepspeed": "ds.json", "lr": "3e-4", "micro_batch_size": "4"}
    assert result.config_files == [str(tmp_path / "ds.json")] and result.exported == {"LR": "3e-4"}


# ================================================================================ names and values
def test_names_match_across_spellings_and_values_by_meaning():
    assert {canonical_name(n) for n in ("lr", "--lr", "learning_rate", "--learning-rate", "LR")} == {"learning_rate"}
    assert canonical_name("--micro-batch-size") == canonical_name("per_device_train_batch_size") == "micro_batch_size"
    assert canonical_name("train_iters") == "max_steps" and canonical_name("optimizer.lr") == "optimizer.learning_rate"
    assert same_value("1e-4", 0.0001) and same_value("true", True) and same_value("8", 8.0) and same_value("None", None)
    assert same_value(["0.9", "0.95"], (0.9, 0.95)) and same_value("'cosine'", "cosine")
    assert not same_value("1e-4", "2e-4") and not same_value("true", False) and not same_value("adam", "sgd")


def test_config_files_flatten_unique_leaves():
    flat = flatten({"training": {"lr": 1e-4, "batch": 8}, "optimizer": {"params": {"eps": 1e-8}},
                    "model": {"hidden_size": 64}, "vision": {"hidden_size": 32}, "hub": {"token": "x"}})
    assert flat == {"lr": 1e-4, "batch": 8, "eps": 1e-8, "model.hidden_size": 64, "vision.hidden_size": 32,
                    "token": "<redacted>"}


# ================================================================================ static packs and compare
def _script(folder: Path, lr: str, seed: str, extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.yaml").write_text(f"training:\n  weight_decay: 0.01\n  warmup_ratio: 0.1\n{extra}")
    path = folder / "run.sh"
    path.write_text(f"LR={lr}\nSEED={seed}\ntorchrun --nproc_per_node 8 train.py --lr $LR --seed=$SEED --bf16 "
                    f"--config cfg.yaml --output-dir out_{seed}\n")
    return path


def _cli(*args: str) -> int:
    return cli_main(["config_check", *map(str, args)])


def _sheets(path: Path) -> dict[str, list[tuple]]:
    wb = openpyxl.load_workbook(path)
    return {ws.title: list(ws.iter_rows(values_only=True)) for ws in wb}


def test_static_collection_and_compare_cli(tmp_path, capsys):
    a = _script(tmp_path / "a", "1e-4", "1")
    b = _script(tmp_path / "b", "0.0001", "1")  # the same learning rate, written differently
    c = _script(tmp_path / "c", "2e-4", "1", extra="  micro_batch_size: 4\n")
    for name, script in (("a", a), ("b", b), ("c", c)):
        assert _cli("-f", "pytorch", "-d", script, "-o", tmp_path / f"{name}.zip") == 0
    with zipfile.ZipFile(tmp_path / "a.zip") as zf:
        assert set(zf.namelist()) == {"pack.json", "env.json", "pip.json", "hyperparameters.json"}
        doc = json.loads(zf.read("hyperparameters.json"))
    assert doc["normalized"]["learning_rate"] == "1e-4" and doc["launch_args"]["seed"] == "1"
    assert doc["config:cfg.yaml"] == {"weight_decay": 0.01, "warmup_ratio": 0.1}
    assert doc["config_check"]["unparsed"] == []

    out = tmp_path / "result"
    assert _cli("-c", tmp_path / "a.zip", tmp_path / "b.zip", "-o", out) == 0
    sheets = _sheets(out / "result.xlsx")
    assert [r[:2] for r in sheets["summary"][1:7]] == [("env", "pass"), ("pip", "pass"), ("hyperparameters", "pass"),
                                                      ("weights", "skipped"), ("dataset", "skipped"),
                                                      ("random", "skipped")]
    # output_dir differs (out_1 both) -> no row; the written-differently lr -> no row
    assert sheets["hyperparameters"][1:] == []
    assert sorted(p.name for p in out.iterdir()) == ["bench", "cmp", "result.xlsx"]

    assert _cli("-c", tmp_path / "a.zip", tmp_path / "c.zip", "-o", out) == 1  # deleted and created again
    rows = {r[0]: r for r in _sheets(out / "result.xlsx")["hyperparameters"][1:]}
    assert set(rows) == {"learning_rate", "micro_batch_size"}
    assert rows["learning_rate"][1:3] == ("1e-4", "2e-4") and rows["learning_rate"][5] == "error"
    assert rows["micro_batch_size"][1:3] == ("(missing)", 4)
    assert "FAIL: hyperparameters differ" in capsys.readouterr().out


def test_existing_outputs_are_not_overwritten(tmp_path):
    script = _script(tmp_path, "1e-4", "1")
    assert _cli("-d", script, "-o", tmp_path / "p.zip") == 0
    before = (tmp_path / "p.zip").read_bytes()
    assert _cli("-d", script, "-o", tmp_path / "p.zip") == 2  # another run's pack
    assert (tmp_path / "p.zip").read_bytes() == before
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(PackPathError, match="not a config_check result"):
        compare_packs(tmp_path / "p.zip", tmp_path / "p.zip", foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    with pytest.raises(PackInputError, match="not a config_check pack"):
        compare_packs(tmp_path / "p.zip", script, tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_pack_members_cannot_escape_the_output(tmp_path):
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("pack.json", json.dumps({"schema": pack.SCHEMA, "run_id": "x"}))
        zf.writestr("../escape.json", "{}")
    with pytest.raises(PackInputError, match="outside the output folder"):
        compare_packs(bad, bad, tmp_path / "out")
    assert not (tmp_path / "escape.json").exists()


def test_environment_and_packages_checks(tmp_path, monkeypatch):
    monkeypatch.setenv("HCCL_DETERMINISTIC", "false")  # the default: equal to unset
    monkeypatch.setenv("HF_TOKEN", "never-packed")
    assert _cli("-o", tmp_path / "a.zip") == 0
    monkeypatch.delenv("HCCL_DETERMINISTIC")
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("CUDA_HOME", "/elsewhere")  # information only
    assert _cli("-o", tmp_path / "b.zip") == 0
    with zipfile.ZipFile(tmp_path / "a.zip") as zf:
        env = json.loads(zf.read("env.json"))["process"]
    assert env.get("HCCL_DETERMINISTIC") == "false" and "HF_TOKEN" not in env
    edit_pip(tmp_path / "b.zip", {"numpy": "0.0.1", "some-unrelated-tool": "9.9"})
    results = {r.name: r for r in compare_packs(tmp_path / "a.zip", tmp_path / "b.zip", tmp_path / "out")}
    assert results["env"].status == "fail"
    assert [(r[1], r[4]) for r in results["env"].rows] == [("CUDA_HOME", "info"), ("NCCL_ALGO", "error")]
    assert results["pip"].status == "fail"
    assert {r[0]: r[3] for r in results["pip"].rows} == {"numpy": "error", "some-unrelated-tool": "info"}


# ================================================================================ dynamic, one process
@pytest.fixture
def restore_random_apis():
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo, which wraps manual_seed
    originals = (torch.rand, torch.manual_seed, torch.nn.functional.dropout, "uniform_" in torch.Tensor.__dict__)
    yield
    remove_patches()
    assert (torch.rand, torch.manual_seed, torch.nn.functional.dropout, "uniform_" in torch.Tensor.__dict__) == originals


def _train(pack_path=None, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    checker = ConfigChecker(model=model, output_zip_path=str(pack_path)) if pack_path else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(5, 6, generator=g)).square().mean()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        losses.append(loss.item())
    return checker, losses, grads, model


def test_dynamic_collection_records_and_does_not_change_training(tmp_path, restore_random_apis):
    _, losses_plain, grads_plain, _ = _train()
    ConfigChecker.apply_patches(fmk="pytorch")
    assert patched()
    checker, losses, grads, model = _train(tmp_path / "p.zip")
    assert losses == losses_plain
    assert all(torch.equal(a, b) for ga, gb in zip(grads, grads_plain) for a, b in zip(ga, gb))
    assert checker.step == 3 and not patched()  # 3 micro-steps recorded; the 4th forward closed the window
    with zipfile.ZipFile(tmp_path / "p.zip") as zf:
        names = set(zf.namelist())
        weights0 = json.loads(zf.read("rank0/step0/weights.json"))
        data0 = json.loads(zf.read("rank0/step0/dataset.json"))
        random_calls = json.loads(zf.read("rank0/random.json"))
    assert {f"rank0/step{s}/{m}" for s in range(3) for m in ("weights.json", "dataset.json")} <= names
    assert "rank0/step3/weights.json" not in names and {"env.json", "pip.json", "hyperparameters.json"} <= names
    torch.manual_seed(0)
    initial = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    w = initial[0].weight.detach()
    assert weights0["0.weight"]["shape"] == [8, 6] and weights0["0.weight"]["max"] == pytest.approx(float(w.max()))
    assert weights0["0.weight"]["norm"] == pytest.approx(float(w.norm()))
    x0 = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    assert data0["args.0"]["mean"] == pytest.approx(float(x0.mean())) and data0["args.0"]["shape"] == [5, 6]
    sites = {(e["step"], e["api"]) for e in random_calls}
    assert ("init", "torch.manual_seed") in sites and ("init", "torch.Tensor.uniform_") in sites
    assert {(s, "torch.nn.functional.dropout") for s in (0, 1, 2)} <= sites
    assert ("init", "torch.cuda.manual_seed_all") not in sites  # called inside torch.manual_seed: not a call site
    seed = next(e for e in random_calls if e["api"] == "torch.manual_seed")
    assert seed["seeds"] == ["0"] and seed["location"].startswith("test_config_check.py:")


def test_identical_runs_pass_and_a_changed_batch_fails(tmp_path, restore_random_apis):
    for name in ("a", "b"):
        ConfigChecker.apply_patches()
        _train(tmp_path / f"{name}.zip")[0].close()
    ConfigChecker.apply_patches()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    checker = ConfigChecker(model=model, output_zip_path=str(tmp_path / "c.zip"), micro_steps=1, hook_forward=False)
    checker.record_micro_step(torch.ones(5, 6))
    checker.close()
    results = {r.name: r for r in compare_packs(tmp_path / "a.zip", tmp_path / "b.zip", tmp_path / "ab")}
    assert overall_pass(results.values()) and results["random"].rows == []
    assert all(results[n].status == "pass" for n in ("env", "pip", "weights", "dataset"))
    results = {r.name: r for r in compare_packs(tmp_path / "a.zip", tmp_path / "c.zip", tmp_path / "ac")}
    assert results["weights"].status == "pass"  # same initial weights; steps 1-2 missing in c
    assert results["dataset"].status == "fail"
    assert results["dataset"].rows[0][:4] == [0, 0, "args.0", "error"]


def test_checker_arguments_are_validated(tmp_path):
    with pytest.raises(ConfigError, match="fmk"):
        ConfigChecker(output_zip_path=str(tmp_path / "p.zip"), fmk="tensorflow")
    with pytest.raises(ConfigError, match="micro_steps"):
        ConfigChecker(output_zip_path=str(tmp_path / "p.zip"), micro_steps=0)
    with pytest.raises(PackPathError, match="is a folder"):
        ConfigChecker(output_zip_path=str(tmp_path))
    (tmp_path / "other.zip").write_bytes(b"not a zip")
    with pytest.raises(PackPathError, match="not this run's pack"):
        ConfigChecker(output_zip_path=str(tmp_path / "other.zip"))


def test_megatron_arguments_are_recorded(tmp_path):
    """Under Megatron-LM (here: the test stand-in of ``megatron.training``), ``get_args()`` is recorded."""
    code = f"""
import sys
sys.path[:0] = [{str(ROOT / 'tests' / 'standins' / 'megatron_lm')!r}, {str(ROOT / 'recipes')!r}]
from megatron.training import get_args  # as Megatron-LM's pretrain_gpt.py does
import megatron_core_gpt as recipe
recipe.set_args(recipe.parse_args(argv=["--lr", "0.0003", "--micro-batch-size", "2"]))
assert get_args().lr == 0.0003
from msprobe_core.config_check import ConfigChecker
ConfigChecker(output_zip_path={str(tmp_path / 'p.zip')!r}).close()
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "RANK": "0"},
                   stdout=subprocess.DEVNULL)
    with zipfile.ZipFile(tmp_path / "p.zip") as zf:
        doc = json.loads(zf.read("hyperparameters.json"))
    assert doc["megatron_args"]["lr"] == 0.0003 and doc["megatron_args"]["micro_batch_size"] == 2
    assert doc["normalized"]["learning_rate"] == 0.0003 and doc["origin"]["learning_rate"] == "megatron_args.lr"


@pytest.mark.slow
def test_mindspore_cell_weights_batches_and_random_calls(tmp_path):
    """fmk="mindspore": a Cell's parameters and inputs (through asnumpy), ``mindspore.set_seed`` recorded."""
    pytest.importorskip("mindspore")
    code = f"""
from msprobe_core.config_check import ConfigChecker
ConfigChecker.apply_patches(fmk="mindspore")
import mindspore as ms, numpy as np
from mindspore import nn, Tensor
ms.set_device("CPU"); ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_seed(3)
net = nn.SequentialCell([nn.Dense(4, 3), nn.ReLU(), nn.Dense(3, 2)])
checker = ConfigChecker(model=net, output_zip_path={str(tmp_path / 'ms.zip')!r}, fmk="mindspore", micro_steps=2)
for i in range(3):
    net(Tensor(np.full((2, 4), float(i), np.float32)))
assert checker.step == 2
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, env={**os.environ, "RANK": "0"})
    with zipfile.ZipFile(tmp_path / "ms.zip") as zf:
        data1 = json.loads(zf.read("rank0/step1/dataset.json"))
        weights = json.loads(zf.read("rank0/step0/weights.json"))
        calls = json.loads(zf.read("rank0/random.json"))
        assert json.loads(zf.read("pack.json"))["framework"] == "mindspore"
    assert data1["args.0"]["mean"] == 1.0 and data1["args.0"]["shape"] == [2, 4]
    assert weights["0.weight"]["shape"] == [3, 4] and len(weights["0.weight"]["hash"]) == 40
    assert {"api": "mindspore.set_seed", "seeds": ["3"]}.items() <= calls[0].items()
