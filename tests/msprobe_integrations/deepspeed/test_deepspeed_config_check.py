"""``config_check_path`` on the DeepSpeed integration, end to end with real ``deepspeed.initialize`` on the CPU
(gloo, ZeRO-2): the drop-in ``initialize(..., config_check_path=...)`` and ``patch_engine(...,
config_check_path=...)`` write msprobe's config_check pack without changing the losses, and
``python -m msprobe_core config_check -c`` finds exactly what differs between two runs.

The runs happen in one subprocess (``ds_support.py config_check``, beside this file): a run without the tool,
then packs ``a`` and ``same`` (learning rate 1e-2, through ``initialize``) and ``lr`` (2e-2, through
``patch_engine``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from dist_run import free_port  # noqa: E402
from config_check_packs import compare_packs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_support  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepspeed_config_check")
    return ds_support.run_single("config_check", folder / "out.json", free_port()), folder


def test_the_packs_leave_the_losses_unchanged(runs):
    result, _ = runs
    assert len(result["ref_losses"]) == ds_support.STEPS * ds_support.GAS
    assert result["losses"]["a"] == result["ref_losses"]  # bit-identical (float hex)
    assert result["losses"]["same"] == result["ref_losses"]
    assert result["losses"]["lr"] != result["ref_losses"]  # the learning rate really differs


def test_pack_holds_every_micro_step_of_the_window_and_the_deepspeed_hyperparameters(runs):
    import zipfile

    result, _ = runs
    with zipfile.ZipFile(result["packs"]["lr"]) as z:  # the patch_engine entry point
        names = set(z.namelist())
        hp = json.loads(z.read("hyperparameters.json"))
        weights = json.loads(z.read("rank0/step0/weights.json"))
    for step in range(3):  # the checker's default window: the first three micro-steps
        assert {f"rank0/step{step}/weights.json", f"rank0/step{step}/dataset.json"} <= names
    assert {"env.json", "pip.json", "rank0/random.json"} <= names
    assert hp["msprobe"]["learning_rate"] == 2e-2 and hp["msprobe"]["zero_stage"] == 2
    assert sorted(weights) == ["0.bias", "0.weight", "2.bias", "2.weight"]  # no wrapper prefix


def test_runs_differing_only_in_learning_rate_fail_only_the_hyperparameters_check(runs):
    result, folder = runs
    summary = compare_packs(result["packs"]["a"], result["packs"]["lr"], folder / "result_lr", 1)
    assert {check for check, outcome in summary.items() if outcome == "fail"} == {"hyperparameters"}, summary
    import openpyxl

    rows = list(openpyxl.load_workbook(folder / "result_lr" / "result.xlsx")["hyperparameters"]
                .iter_rows(min_row=2, values_only=True))
    assert [row[:3] for row in rows] == [("learning_rate", 1e-2, 2e-2)], rows


def test_identical_runs_pass_every_check(runs):
    result, folder = runs
    summary = compare_packs(result["packs"]["a"], result["packs"]["same"], folder / "result_same", 0)
    assert "fail" not in summary.values(), summary
