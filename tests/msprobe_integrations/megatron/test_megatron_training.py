"""The launch flags on Megatron-LM's own training loop: ``megatron.training`` as megatron-core 0.17+ ships it
(tested with 0.19.2, ``make test-megatron-latest``), for real, on the CPU.

``python -m msprobe_integrations.megatron recipes/pretrain_gpt.py <Megatron args> --msprobe-config ...
--msprobe-monitor-config ... --msprobe-config-check ...`` runs Megatron's ``pretrain(cfg_container, ...)`` (the
script parses its arguments with ``parse_and_validate_args(extra_args_provider=...)``, where the launcher adds
the flags), one rank and two data-parallel ranks with the distributed optimizer, over gloo. The CPU stand-ins
are ``recipes/megatron_cpu.py``'s (``prepare_megatron_training``, each patch explained there); the rest is
Megatron's own arguments (``CPU_ARGS``). Megatron writes every iteration's ``lm loss`` to TensorBoard at full
float32 precision: read back with tensorboard's reader, they are the same with and without the flags.

Collected only where ``megatron.training`` is installed (``conftest.py`` beside this file): megatron-core
0.16.1 of the default venv has none, and its launcher tests use the stand-in in ``tests/standins``.
"""

from __future__ import annotations

import csv
import json
import math
import sys
import zipfile
from pathlib import Path

import pytest

import megatron_support as ms
from dist_run import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.megatron_training]

ITERS = 3
PACK = "config_check_pack.zip"
PRETRAIN_GPT = str(Path(ms.ROOT) / "recipes" / "pretrain_gpt.py")
CPU_ARGS = [
    # the model and the run: a tiny GPT, two micro-batches per iteration, synthetic tokens (NullTokenizer)
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--vocab-size", "128", "--micro-batch-size", "4", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    # the CPU: gloo, weights created on the CPU, torch's own modules instead of the fused CUDA kernels
    "--distributed-backend", "gloo", "--use-cpu-initialization", "--transformer-impl", "local",
    "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
    # the rerun state machine saves and restores the CUDA random state around every iteration
    "--rerun-mode", "disabled",
]
MONITOR = {"targets": {}, "xy_distribution": True, "wg_distribution": True, "mv_distribution": True,
           "param_distribution": True, "ops": ["min", "max", "norm", "mean", "nans"], "format": ["csv"]}


def tensorboard_losses(folder: Path) -> list[float]:
    """Megatron's ``lm loss`` per iteration, read back from its TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    scalars = events.Scalars("lm loss")
    assert [s.step for s in scalars] == list(range(1, ITERS + 1))
    return [s.value for s in scalars]


def _command(folder: Path, probed: bool, extra: tuple = ()) -> list[str]:
    """The launcher on pretrain_gpt.py in ``folder`` (TensorBoard in ``folder/tb``; with ``probed``, dump,
    monitor and config_check on)."""
    folder.mkdir()
    args = ["-m", "msprobe_integrations.megatron", PRETRAIN_GPT, *CPU_ARGS, *extra, "--gpt-recipe-tag", "t",
            "--tensorboard-dir", str(folder / "tb")]
    if probed:
        (folder / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L0",
                                                      "dump_path": str(folder / "dump")}))
        (folder / "monitor.json").write_text(json.dumps(MONITOR))
        args += ["--msprobe-config", str(folder / "dump.json"), "--msprobe-monitor-config",
                 str(folder / "monitor.json"), "--msprobe-monitor-output-dir", str(folder / "mon"),
                 "--msprobe-config-check", str(folder / PACK)]
    return args


def _one_rank(folder: Path, probed: bool) -> list[float]:
    res = ms.run_child([sys.executable, *_command(folder, probed)], cwd=str(folder.parent), timeout=400)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "building GPT model" in res.stdout  # the script's own model_provider ran in Megatron's get_model
    return tensorboard_losses(folder / "tb")


def _two_ranks(folder: Path, probed: bool) -> list[float]:
    cmd = _command(folder, probed, ("--use-distributed-optimizer",))
    torchrun(cmd[0], *cmd[1:], timeout=400, cwd=str(folder.parent), env={"PYTHONWARNINGS": "ignore"})
    return tensorboard_losses(folder / "tb")


def _rows(path: Path) -> dict[str, dict[str, float]]:
    with open(path) as f:
        return {r["name"]: {k: float(v) for k, v in r.items() if k not in ("name", "step")} for r in csv.DictReader(f)}


def _check_outputs(folder: Path, ranks: int) -> None:
    """A dump step and monitor files per iteration and rank, Megatron's args in the hyperparameters, the pack."""
    dump, mon = folder / "dump", folder / "mon"
    assert sorted(p.name for p in dump.iterdir() if p.is_dir()) == [f"step{i}" for i in range(1, ITERS + 1)]
    micro_batches = 8 // (4 * ranks)  # global batch 8, micro-batch 4, per data-parallel rank
    for rank in range(ranks):
        data = json.loads((dump / "step2" / f"rank{rank}" / "dump.json").read_text())["data"]
        layer = "Module.0.decoder.layers.0.mlp.linear_fc1.ColumnParallelLinear"
        assert {f"{layer}.{d}.{m}" for d in ("forward", "backward") for m in range(micro_batches)} <= data.keys()
        assert f"{layer}.forward.{micro_batches}" not in data
        for i in range(1, ITERS + 1):
            grads = _rows(mon / f"rank{rank}" / f"grad_{i}-{i}.csv")
            assert grads["decoder.layers.0.mlp.linear_fc1.weight"]["nans"] == 0
            assert (mon / f"rank{rank}" / f"exp_avg_{i}-{i}.csv").exists()
    hp = json.loads((dump / "hyperparameters.json").read_text())
    assert hp["source"] == "megatron" and hp["args"]["gpt_recipe_tag"] == "t"  # the script's provider composed
    assert hp["args"]["msprobe_config"] == str(folder / "dump.json") and hp["args"]["train_iters"] == ITERS
    assert hp["args"]["tokenizer_type"] == "NullTokenizer"  # args_defaults of parse_and_validate_args kept
    assert hp["normalized"]["max_steps"] == ITERS and hp["normalized"]["data_parallel_size"] == ranks
    leaf = "DistributedOptimizer" if ranks > 1 else "FP32Optimizer"
    assert hp["megatron_optimizer"] == {"class": "ChainedOptimizer", "chained": [leaf]}
    with zipfile.ZipFile(folder / PACK) as z:
        pack = json.loads(z.read("hyperparameters.json"))
        names = set(z.namelist())
    assert pack["config_check"]["sections"][0] == "megatron_args"
    assert pack["megatron_args"]["lr"] == 1e-2 and pack["megatron_args"]["num_layers"] == 2
    assert {f"rank{r}/step0/weights.json" for r in range(ranks)} <= names


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_training")
    return root, _one_rank(root / "plain", probed=False), _one_rank(root / "probed", probed=True)


def test_pretrain_takes_a_config_container_and_the_recipe_sees_it():
    import megatron_core_gpt  # recipes/ is on sys.path through megatron_support
    import pretrain_gpt
    from megatron.training import pretrain

    assert pretrain_gpt.takes_config_container(pretrain)
    assert not pretrain_gpt.takes_config_container(megatron_core_gpt.pretrain)  # Megatron-LM's older signature


def test_one_rank_dump_monitor_config_check_losses_unchanged(one_rank):
    root, plain, probed = one_rank
    assert probed == plain and len(set(plain)) == ITERS
    _check_outputs(root / "probed", ranks=1)


@pytest.mark.distributed
def test_two_data_parallel_ranks_distributed_optimizer_losses_unchanged(one_rank, tmp_path):
    """DP=2 with the distributed optimizer: losses unchanged by the flags; each rank's monitor holds the
    statistics of the full gradients and Adam moments (its shard combined over the data-parallel group), the
    same on both ranks and those of the one-rank run up to float32 summation order."""
    root, one_rank_plain, _ = one_rank
    plain = _two_ranks(tmp_path / "plain", probed=False)
    probed = _two_ranks(tmp_path / "probed", probed=True)
    assert probed == plain
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(plain, one_rank_plain))
    _check_outputs(tmp_path / "probed", ranks=2)
    for kind in ("grad", "param", "exp_avg", "exp_avg_sq"):
        single = _rows(root / "probed" / "mon" / "rank0" / f"{kind}_2-2.csv")
        per_rank = [_rows(tmp_path / "probed" / "mon" / f"rank{r}" / f"{kind}_2-2.csv") for r in (0, 1)]
        assert per_rank[0] == per_rank[1] and per_rank[0].keys() == single.keys()
        for name, values in single.items():
            for op, v in values.items():
                assert math.isclose(per_rank[0][name][op], v, rel_tol=1e-3, abs_tol=1e-7), (kind, name, op)
