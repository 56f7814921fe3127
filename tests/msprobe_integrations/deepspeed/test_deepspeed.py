"""The DeepSpeed engine patch against real DeepSpeed on the CPU (gloo): ZeRO 0-3, two processes, HF Trainer.

Each DeepSpeed run happens in a subprocess (``ds_support.py`` beside this file), once per module, so the process group,
DeepSpeed's global state and the one-time op compile (~40 s, cached in ``~/.cache/torch_extensions``) stay
out of the pytest process; the tests read the JSON the runs leave.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from dist_run import free_port, torchrun  # noqa: E402

SUPPORT = Path(__file__).resolve().parent / "ds_support.py"
sys.path.insert(0, str(SUPPORT.parent))
import ds_support  # noqa: E402

PARAMS = ("0.weight", "0.bias", "2.weight", "2.bias")
SHARDED_KINDS = ("param", "grad", "exp_avg", "exp_avg_sq")
pytestmark = pytest.mark.slow


def _single(mode: str, out: Path) -> dict:
    return ds_support.run_single(mode, out, free_port())


def _two_processes(out: Path) -> list:
    torchrun(SUPPORT, "dist", str(out), timeout=420, cwd=ds_support.ROOT,
             env={"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"})
    return [json.loads(out.with_name(f"out.rank{r}.json").read_text()) for r in (0, 1)]


def _once(tmp_path_factory, name: str, run) -> tuple:
    """Run ``run(out_json)`` once per test session, also under pytest-xdist (the workers share the result
    through a file lock in the session's common temporary folder, as pytest-xdist documents)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / f"deepspeed_{name}"
    done = folder / "result.json"
    with FileLock(str(root / f"deepspeed_{name}.lock")):
        if not done.exists():
            folder.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps(run(folder / "out.json")))
    return json.loads(done.read_text()), folder


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return _once(tmp_path_factory, "matrix", lambda out: _single("matrix", out))[0]


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    return _once(tmp_path_factory, "hf", lambda out: _single("hf", out))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _once(tmp_path_factory, "dist", _two_processes)


def _config(matrix: dict, section: str, key: str) -> dict:
    """One configuration's result; a configuration that could not run fails only the tests that need it,
    with DeepSpeed's own reason."""
    run = matrix[section][key]
    if "error" in run:
        pytest.fail(f"the {section} configuration {key} could not run on this machine: {run['error']}", pytrace=False)
    return run


STAGES = pytest.mark.parametrize("stage", ["0", "1", "2", "3"], ids=lambda s: f"zero{s}")
PATCHED_STAGES = pytest.mark.parametrize("stage", ["1", "2", "3"], ids=lambda s: f"zero{s}")


def _close(a: dict, b: dict, rel: float = 1e-5, abs_: float = 1e-9) -> bool:
    """Two statistics rows equal to float tolerance (different summation orders of the same numbers)."""
    for op in ("min", "max", "norm", "mean"):
        if not math.isclose(a[op], b[op], rel_tol=rel if op == "norm" else 1e-4, abs_tol=abs_):
            return False
    return a["nans"] == b["nans"] and math.isclose(a["zeros"], b["zeros"], abs_tol=1e-6)


def _total_norm(metrics: dict) -> float:
    return math.sqrt(sum(row["norm"] ** 2 for row in metrics["metrics"]["grad"].values()))


# --------------------------------------------------------------------------------------------- one process
@STAGES
def test_losses_bit_identical_with_the_patch_at_every_stage(matrix, stage):
    run = _config(matrix, "stages", stage)
    assert run["losses"] == run["ref_losses"], f"ZeRO-{stage}: the patch changed the losses"
    assert run["weights_equal"], f"ZeRO-{stage}: the patch changed the trained weights"


@STAGES
def test_readers_follow_where_zero_keeps_the_state(matrix, stage):
    expected = {"0": "Stage0Reader", "1": "FragmentReader", "2": "FragmentReader", "3": "Stage3Reader"}[stage]
    assert _config(matrix, "stages", stage)["reader"] == expected


@PATCHED_STAGES
def test_monitor_values_equal_across_stages(matrix, stage):
    """Weights, gradients and Adam states read from param.grad / ZeRO fragments / ds_tensor partitions
    give the statistics of a stage-0 run of the same model and data (activations too)."""
    base = _config(matrix, "stages", "0")["metrics"]
    assert [m["step"] for m in base] == [0, 1, 2]  # engine.global_steps
    metrics = _config(matrix, "stages", stage)["metrics"]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for ref, got in zip(base, metrics):
        for kind in SHARDED_KINDS:
            assert sorted(got["metrics"][kind]) == sorted(PARAMS), (stage, kind)
            for name in PARAMS:
                row = got["metrics"][kind][name]
                assert not math.isnan(row["min"]), f"ZeRO-{stage} reported {kind} {name} as empty"
                assert _close(ref["metrics"][kind][name], row), (stage, got["step"], kind, name, row)
        assert sorted(got["metrics"]["actv"]) == sorted(ref["metrics"]["actv"])
        for name, row in ref["metrics"]["actv"].items():
            assert _close(row, got["metrics"]["actv"][name]), (stage, name)


@PATCHED_STAGES
def test_gradients_are_read_before_clipping(matrix, stage):
    """The ds_config clips to 0.05; the monitor's total gradient norm is DeepSpeed's own pre-clip norm."""
    for m in _config(matrix, "stages", stage)["metrics"]:
        total = _total_norm(m)
        assert total > 5 * ds_support.CLIP
        assert math.isclose(total, m["ds_grad_norm"], rel_tol=1e-5), (stage, m["step"], total, m["ds_grad_norm"])
    for m0, m in zip(_config(matrix, "stages", "0")["metrics"], _config(matrix, "stages", stage)["metrics"]):
        assert math.isclose(_total_norm(m0), _total_norm(m), rel_tol=1e-5)


@pytest.mark.parametrize("stage, optimizer", [("0", "FP16_UnfusedOptimizer"), ("2", "DeepSpeedZeroOptimizer")],
                         ids=["zero0", "zero2"])
def test_fp16_gradients_are_unscaled(matrix, stage, optimizer):
    """fp16 with a loss scale of 16 on any CPU (oneDNN fp16 or not: ``ds_support.allow_fp16_on_any_cpu``):
    ZeRO-2 keeps scaled gradients, DeepSpeed's stage-0 fp16 optimizer does not; both report the true
    gradients (DeepSpeed's own norm) and the fp32 masters' Adam states."""
    run = _config(matrix, "fp16", stage)
    assert run["optimizer"] == optimizer
    assert run["loss_scale"] >= 8
    for m in run["metrics"]:
        assert math.isclose(_total_norm(m), m["ds_grad_norm"], rel_tol=1e-5), (stage, m)
        assert set(m["metrics"]) == set(SHARDED_KINDS)


def test_fp16_first_step_gradients_agree_between_stage0_and_zero2(matrix):
    """The same fp16 gradients at the first step (later steps differ: DeepSpeed's two fp16 paths update
    differently)."""
    z0, z2 = _config(matrix, "fp16", "0"), _config(matrix, "fp16", "2")
    assert math.isclose(_total_norm(z0["metrics"][0]), _total_norm(z2["metrics"][0]), rel_tol=1e-5)


@STAGES
def test_dump_one_step_per_optimizer_step_with_every_micro_batch(matrix, stage):
    run = _config(matrix, "stages", stage)
    dump = Path(run["dump"])
    steps = sorted(p.name for p in dump.iterdir() if p.is_dir())
    assert steps == ["step0", "step1", "step2"], (stage, steps)  # nothing after unpatch (4 steps ran)
    assert run["global_steps"] == 4
    data = json.loads((dump / "step1" / "rank0" / "dump.json").read_text())["data"]
    for direction in ("forward", "backward"):
        assert f"Module.0.Linear.{direction}.0" in data and f"Module.0.Linear.{direction}.1" in data, (stage, direction)
    assert "Module.0.Linear.forward.2" not in data
    out = data["Module.2.Linear.forward.1"]["output"][0]
    assert out["shape"] == [ds_support.MICRO, 5] and not math.isnan(out["Norm"])
    csv_steps = sorted(p.name for p in (Path(run["monitor"]) / "rank0").glob("grad_*.csv"))
    assert csv_steps == ["grad_0-0.csv", "grad_1-1.csv", "grad_2-2.csv"]


@STAGES
def test_patch_is_idempotent_and_unpatch_restores_the_engine(matrix, stage):
    run = _config(matrix, "stages", stage)
    assert run["same_engine"]          # patch_engine returns the engine; a second call too
    assert run["single_layer"]         # ... without wrapping the wrappers again
    assert run["restored"]             # unpatch leaves no instance attribute behind


def test_hyperparameters_from_the_ds_config(matrix):
    run = _config(matrix, "stages", "2")
    for folder in (Path(run["dump"]), Path(run["monitor"])):
        doc = json.loads((folder / "hyperparameters.json").read_text())
        norm = doc["normalized"]
        assert doc["source"] == "deepspeed"
        assert norm["zero_stage"] == 2 and norm["micro_batch_size"] == ds_support.MICRO
        assert norm["gradient_accumulation_steps"] == ds_support.GAS and norm["global_batch_size"] == ds_support.MICRO * ds_support.GAS
        assert norm["mixed_precision"] == "fp32" and norm["optimizer"] == "AdamW" and norm["learning_rate"] == 1e-2
        assert norm["max_grad_norm"] == ds_support.CLIP
        assert doc["ds_config"]["zero_optimization"] == {"stage": 2}
        assert doc["optimizer"]["class"].endswith("AdamW") and len(doc["optimizer"]["param_groups"]) == 2


# --------------------------------------------------------------------------------------------- two processes
@pytest.mark.distributed
def test_two_process_zero2_norms_equal_on_both_ranks_and_to_one_process(two_ranks, matrix):
    (r0, r1), _ = two_ranks
    assert r0["world"] == r1["world"] == 2
    one = _config(matrix, "global", "2")["metrics"]
    for a, b, ref in zip(r0["z2"]["metrics"], r1["z2"]["metrics"], one):
        for kind in SHARDED_KINDS:
            assert a["metrics"][kind] == b["metrics"][kind], kind  # the same combined scalars on both ranks
            for name in PARAMS:
                assert _close(ref["metrics"][kind][name], a["metrics"][kind][name]), (a["step"], kind, name)
        assert math.isclose(_total_norm(a), ref["ds_grad_norm"], rel_tol=1e-5)
        assert math.isclose(_total_norm(a), a["ds_grad_norm"], rel_tol=1e-5)


@pytest.mark.distributed
def test_two_process_zero3_monitor_on_one_rank_does_not_hang(two_ranks, matrix):
    """module_ranks=[0]: rank 1 writes nothing but joins the all-reduces, so rank 0 has the full values."""
    (r0, r1), folder = two_ranks
    assert all(m == {"ds_grad_norm": m["ds_grad_norm"]} for m in r1["z3_rank0"]["metrics"])
    one = _config(matrix, "global", "3")["metrics"]
    for a, ref in zip(r0["z3_rank0"]["metrics"], one):
        for kind in SHARDED_KINDS:
            for name in PARAMS:
                assert _close(ref["metrics"][kind][name], a["metrics"][kind][name]), (a["step"], kind, name)
    assert (folder / "mon_z3_rank0" / "rank0").is_dir() and not (folder / "mon_z3_rank0" / "rank1").exists()


# --------------------------------------------------------------------------------------------- HF Trainer
def test_hf_trainer_with_deepspeed_zero2(hf_run):
    result, folder = hf_run
    ref, tool = result["ref"], result["tool"]
    assert tool["engine"] == "DeepSpeedEngine" and tool["optimizer"] == "DeepSpeedZeroOptimizer"
    assert tool["losses"] == ref["losses"] and len(tool["losses"]) == 4
    assert [m["step"] for m in tool["metrics"]] == [1, 2, 3, 4]  # the Trainer's global steps
    for m, logged in zip(tool["metrics"], tool["grad_norm"]):
        assert logged > 0.5  # max_grad_norm=0.5 clipped it; the monitor saw the gradients before
        assert math.isclose(_total_norm(m), logged, rel_tol=1e-5)
        assert set(m["metrics"]) == {"param", "grad", "exp_avg", "exp_avg_sq"}
        assert not any(math.isnan(row["min"]) for kind in m["metrics"].values() for row in kind.values())
    dump = folder / "hf_dump"
    assert sorted(p.name for p in dump.iterdir() if p.is_dir()) == ["step1", "step2", "step3", "step4"]
    data = json.loads((next((dump / "step2").iterdir()) / "dump.json").read_text())["data"]
    layer = "Module.model.layers.0.mlp.down_proj.Linear"
    assert f"{layer}.forward.0" in data and f"{layer}.forward.1" in data and f"{layer}.forward.2" not in data
    hp = json.loads((dump / "hyperparameters.json").read_text())
    assert hp["ds_config"]["zero_optimization"]["stage"] == 2


# --------------------------------------------------------------------------------------------- on-anomaly capture
def test_an_alert_under_zero2_captures_the_next_step_of_its_module(tmp_path_factory):
    from msprobe_core.dumpdir.rank_dump import load_rank_dump

    result, folder = _once(tmp_path_factory, "capture", lambda out: _single("capture", out))
    ref, cap = result["ref"], result["capture"]
    assert cap["losses"] == ref["losses"]  # the capture changes no number (NaN from the fault on, in both)
    assert (cap["step"], cap["module"]) == (2, "2") and ref["capture"] is None
    assert Path(cap["capture"]) == folder / "capture" / "captures" / "step2_2" / "step3" / "rank0"
    dump = load_rank_dump(Path(cap["capture"]))  # the compare reader
    assert dump.level == "mix" and "Module.2.Linear.forward.0" in dump.data
    assert all(".2." in name or name.startswith("Functional.linear.") for name in dump.data)  # only module 2


# --------------------------------------------------------------------------------------------- in process
def test_patch_engine_refuses_what_it_cannot_patch():
    from deepspeed.runtime.engine import DeepSpeedEngine

    from msprobe_core.errors import ConfigError
    from msprobe_integrations.deepspeed import DeepSpeedIntegrationError, patch_engine, unpatch

    import torch

    with pytest.raises(DeepSpeedIntegrationError, match="DeepSpeedEngine"):
        patch_engine(torch.nn.Linear(2, 2), monitor_config_path={})
    bare = DeepSpeedEngine.__new__(DeepSpeedEngine)  # passes the type check, never initialised
    with pytest.raises(ConfigError, match="config_path"):
        patch_engine(bare)
    assert unpatch(bare) is bare  # unpatching an unpatched engine does nothing


def test_follow_trainer_engine_undo_restores_the_class():
    from deepspeed.runtime.engine import DeepSpeedEngine

    from msprobe_integrations.deepspeed.trainer_bridge import follow_trainer_engine

    original = DeepSpeedEngine.__dict__["_take_model_step"]

    class NoMonitor:
        monitor = None

    handle = follow_trainer_engine(NoMonitor(), lambda: 1)
    assert DeepSpeedEngine.__dict__["_take_model_step"] is not original
    assert DeepSpeedEngine._take_model_step.__wrapped__ is original
    handle.remove()
    assert DeepSpeedEngine.__dict__["_take_model_step"] is original
    handle.remove()  # twice is harmless
    assert DeepSpeedEngine.__dict__["_take_model_step"] is original
