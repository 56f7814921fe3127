"""``--msprobe-config-check PACK.zip`` on the Megatron integration, end to end with real megatron-core on the
CPU: the launcher (``python -m msprobe_integrations.megatron recipes/pretrain_gpt.py``, against the test
stand-in of Megatron-LM's ``megatron.training``) and the megatron-core recipe (``recipes/megatron_core_gpt.py``,
the flag through ``add_args``) write msprobe's config_check pack with Megatron's arguments, without changing
the losses; ``python -m msprobe_core config_check -c`` finds exactly what differs between two runs.

Each run works in a folder of its own and writes its pack ``config_check_pack.zip`` there; the identical run
names it by its absolute path, so the flag's own value (one of Megatron's arguments) differs between the two
runs, which config_check shows as information, never as a failure.
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import megatron_support as ms  # noqa: E402
from config_check_packs import compare_packs  # noqa: E402

pytestmark = pytest.mark.slow
PACK = "config_check_pack.zip"
RECIPE = str(Path(ms.ROOT) / "recipes" / "megatron_core_gpt.py")
PRETRAIN_GPT = str(Path(ms.ROOT) / "recipes" / "pretrain_gpt.py")


def _train(folder: Path, cmd: list, env: dict | None = None) -> list[str]:
    """``cmd`` in ``folder`` (two iterations); the losses it printed."""
    folder.mkdir()
    res = ms.run_child([sys.executable, *cmd, "--train-iters", "2"], env=env, cwd=str(folder))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    losses = ms.lm_losses(res.stdout)
    assert len(losses) == 2
    return losses


def _launch(folder: Path, *args: str, pack: str = PACK) -> list[str]:
    """The zero-edit launcher with ``--msprobe-config-check PACK``."""
    return _train(folder, ["-m", "msprobe_integrations.megatron", PRETRAIN_GPT, "--msprobe-config-check", pack, *args],
                  env={"EXTRA_PATH": ms.STANDIN})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_config_check")
    losses = {"plain": _train(root / "plain", [RECIPE]),
              "a": _launch(root / "a"),
              "lr": _launch(root / "lr", "--lr", "2e-2"),
              # the flag's own value differs (an absolute path): a tool setting, never a failing difference
              "same": _launch(root / "same", pack=str(root / "same" / PACK)),
              "recipe": _train(root / "recipe", [RECIPE, "--msprobe-config-check", PACK])}
    return root, losses


def _hyperparameters(pack: Path) -> dict:
    with zipfile.ZipFile(pack) as z:
        return json.loads(z.read("hyperparameters.json"))


def _summary(root: Path, bench: str, cmp: str, name: str, status: int) -> dict:
    return compare_packs(_pack(root, bench), _pack(root, cmp), root / name, status)


def _pack(root: Path, run: str) -> Path:
    """The run's pack (``same`` named its pack by an absolute path, the others by a relative one)."""
    return root / run / PACK


def test_the_flag_leaves_the_losses_unchanged(runs):
    _, losses = runs
    assert losses["a"] == losses["plain"] and losses["same"] == losses["plain"] and losses["recipe"] == losses["plain"]
    assert losses["lr"] != losses["plain"]  # the learning rate really differs


@pytest.mark.parametrize("run", ["a", "recipe"], ids=["launcher", "megatron_core_recipe"])
def test_pack_holds_megatrons_arguments_and_the_first_micro_steps(runs, run):
    root, _ = runs
    pack = root / run / PACK
    hp = _hyperparameters(pack)
    assert hp["config_check"]["sections"][0] == "megatron_args"  # they win over the integration's summary
    args = hp["megatron_args"]
    assert args["lr"] == 1e-2 and args["num_layers"] == 2 and args["micro_batch_size"] == 4
    assert args["train_iters"] == 2 and args["msprobe_config_check"] == PACK
    with zipfile.ZipFile(pack) as z:
        names = set(z.namelist())
        weights = json.loads(z.read("rank0/step0/weights.json"))
    for step in range(3):  # two micro-batches per iteration: the window spans an optimizer step
        assert {f"rank0/step{step}/weights.json", f"rank0/step{step}/dataset.json"} <= names
    assert "decoder.layers.0.mlp.linear_fc1.weight" in weights


def test_runs_differing_only_in_learning_rate_fail_only_the_hyperparameters_check(runs):
    import openpyxl

    root, _ = runs
    summary = _summary(root, "a", "lr", "result_lr", 1)
    assert {check for check, outcome in summary.items() if outcome == "fail"} == {"hyperparameters"}, summary
    rows = list(openpyxl.load_workbook(root / "result_lr" / "result.xlsx")["hyperparameters"]
                .iter_rows(min_row=2, values_only=True))
    assert [row[:5] for row in rows] == [("learning_rate", 1e-2, 2e-2, "megatron_args.lr", "megatron_args.lr")], rows


def test_identical_runs_pass_every_check(runs):
    root, _ = runs
    summary = _summary(root, "a", "same", "result_same", 0)
    assert "fail" not in summary.values(), summary
