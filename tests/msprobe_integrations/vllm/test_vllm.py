"""``msprobe_integrations.vllm.dump_tokens`` on CPU.

vLLM itself cannot run here, so the engine objects are STAND-INS (tests/standins/vllm_engine.py) that only
reproduce the shapes the integration relies on: the in-process attribute paths, ``collective_rpc`` /
``apply_model`` with vLLM's calling rules, and real worker subprocesses. The model (a real torch module run
with vLLM's call pattern) and the dump core are real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import vllm_engine as S
from msprobe_core.errors import ConfigError, MsprobeError, TokenRangeError, UnknownKeyError
from msprobe_core.pytorch import PrecisionDebugger
from msprobe_integrations import vllm as V

ROOT = Path(__file__).resolve().parents[3]
CFG = {"task": "statistics", "level": "L0"}
REFERENCE = S.run_generation(S.build_model(0), S.PROMPT, 5)
ORIGINAL_LINEAR = torch.nn.functional.linear


def load_dump(rank_dir) -> dict:
    return json.loads((Path(rank_dir) / "dump.json").read_text())["data"]


def forward_indices(data: dict, base: str) -> list[int]:
    """The call indices n of ``{base}.forward.{n}`` records (L0 naming)."""
    prefix = f"{base}.forward."
    return sorted(int(k[len(prefix):]) for k in data if k.startswith(prefix))


def assert_three_decode_passes(data: dict) -> None:
    """token_range [1, 3]: three forward passes, all decode steps (one token in), none the prefill."""
    assert forward_indices(data, "Module.embed_tokens.Embedding") == [0, 1, 2]
    assert forward_indices(data, "Module.norm.LayerNorm") == [0, 1, 2]
    for n in range(3):
        assert data[f"Module.embed_tokens.Embedding.forward.{n}"]["input_args"][0]["shape"] == [1, 1]


def assert_untouched(model: torch.nn.Module) -> None:
    assert torch.nn.functional.linear is ORIGINAL_LINEAR  # no API is wrapped
    assert not model._forward_pre_hooks and not model._forward_hooks


# ====================================================================================== in process
@pytest.mark.parametrize("shape", sorted(S._IN_PROCESS_SHAPES))
def test_in_process_engine_every_documented_path(tmp_path, shape):
    model = S.build_model(0)
    llm = S.InProcessLLM(model, shape)
    session = V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path))
    assert session.route == "in_process"
    assert llm.generate() == REFERENCE
    dirs = session.finish()
    assert dirs == [str(tmp_path / "step0" / f"proc{os.getpid()}")]
    assert_three_decode_passes(load_dump(dirs[0]))
    assert_untouched(model)


@pytest.mark.parametrize("level", ["L0", "L1", "mix"])
def test_in_process_levels_and_tokens_unchanged(tmp_path, level):
    model = S.build_model(0)
    llm = S.InProcessLLM(model)
    with V.dump_tokens(llm, {"task": "statistics", "level": level}, [1, 3], dump_path=str(tmp_path)) as session:
        assert llm.generate() == REFERENCE
    data = load_dump(session.rank_dirs[0])
    if level != "L1":
        assert_three_decode_passes(data)
    if level != "L0":
        emb = sorted(k for k in data if k.startswith("Functional.embedding."))
        assert emb == [f"Functional.embedding.{n}.forward" for n in range(3)]
        assert all(data[k]["input_args"][0]["shape"] == [1, 1] for k in emb)
        # 2 blocks x (up, down) inside forward per pass; lm_head runs outside forward
        inside = [k for k in data if k.startswith("Functional.linear.")]
        assert len(inside) >= 3 * 4
    else:
        assert not any(k.startswith(("Functional.", "Tensor.", "Torch.")) for k in data)


def test_in_process_config_file_and_prefill_only(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"task": "statistics", "level": "L0", "dump_path": str(tmp_path / "dump")}))
    llm = S.InProcessLLM(S.build_model(0))
    with V.dump_tokens(llm, str(cfg), (0, 0)) as session:
        llm.generate()
    data = load_dump(session.rank_dirs[0])
    assert session.rank_dirs[0].startswith(str(tmp_path / "dump"))
    assert forward_indices(data, "Module.embed_tokens.Embedding") == [0]
    assert data["Module.embed_tokens.Embedding.forward.0"]["input_args"][0]["shape"] == [1, len(S.PROMPT)]


# ============================================================================ collective_rpc / extension
def test_collective_rpc_in_process_engine_names_the_rank_folder(tmp_path):
    worker = S.FakeWorker(0, S.build_model(0), S.fake_vllm_config())
    llm = S.InProcessRpcLLM(worker)
    session = V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path))
    assert session.route == "collective_rpc"
    assert [w["rank"] for w in session.workers] == [0]
    assert llm.generate() == REFERENCE
    assert session.finish() == [str(tmp_path / "step0" / "rank0")]
    assert session.finish() == [str(tmp_path / "step0" / "rank0")]  # idempotent
    assert_three_decode_passes(load_dump(tmp_path / "step0" / "rank0"))


def test_extension_route_is_chosen_when_configured(tmp_path):
    cfg = S.fake_vllm_config(worker_extension_cls=V.EXTENSION_CLASS)
    llm = S.InProcessRpcLLM(S.FakeWorkerWithExtension(0, S.build_model(0), cfg))
    with V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path)) as session:
        assert session.route == "extension"
        assert llm.generate() == REFERENCE
    assert_three_decode_passes(load_dump(tmp_path / "step0" / "rank0"))


def test_apply_model_route_and_apply_model_only_engine(tmp_path):
    worker = S.FakeWorker(0, S.build_model(0), S.fake_vllm_config())

    class ApplyModelOnlyLLM:  # stand-in: an LLM that offers apply_model but no collective_rpc
        llm_engine = SimpleNamespace(vllm_config=worker.vllm_config)

        def apply_model(self, func):
            return [func(worker.get_model())]

    llm = ApplyModelOnlyLLM()
    with V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path)) as session:
        assert session.route == "apply_model"
        assert worker.execute_generation(S.PROMPT, 5) == REFERENCE
    assert session.rank_dirs == [str(tmp_path / "step0" / f"proc{os.getpid()}")]  # no worker object, no rank
    assert_three_decode_passes(load_dump(session.rank_dirs[0]))


def test_explicit_route_must_exist(tmp_path):
    llm = S.InProcessLLM(S.build_model(0))
    for route in ("collective_rpc", "extension", "apply_model"):
        with pytest.raises(ConfigError, match=f"'route' = '{route}'.*has no"):
            V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path), route=route)
    with pytest.raises(ConfigError, match="'route' = 'fast'.*in_process, collective_rpc"):
        V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path), route="fast")


def test_llm_without_a_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="'llm' = 'object'.*collective_rpc"):
        V.dump_tokens(object(), CFG, [1, 3], dump_path=str(tmp_path))


def test_worker_without_model_raises_worker_error(tmp_path):
    worker = S.FakeWorker(0, S.build_model(0), S.fake_vllm_config())
    worker.model_runner = SimpleNamespace()  # nothing to find
    with pytest.raises(V.WorkerDumpError, match="worker rank 0 .*no torch.nn.Module found.*model_runner.get_model"):
        V.dump_tokens(S.InProcessRpcLLM(worker), CFG, [1, 3], dump_path=str(tmp_path))
    assert not tmp_path.joinpath("step0").exists()


# ============================================================================================ eager
NOT_EAGER = {
    "default (compile + graphs)": (dict(enforce_eager=False), ["CUDA graphs", "torch.compile"]),
    "eager but compile forced": (dict(enforce_eager=True, mode=S.CompilationMode.VLLM_COMPILE), ["torch.compile is on"]),
    "full decode graphs": (dict(enforce_eager=False, mode=S.CompilationMode.NONE,
                                cudagraph_mode=S.CUDAGraphMode.FULL_DECODE_ONLY), ["cudagraph_mode=FULL_DECODE_ONLY"]),
    "legacy level 3": (dict(enforce_eager=False, legacy=True), ["compilation_config.level=3", "use_cudagraph=True"]),
}


@pytest.mark.parametrize("case", sorted(NOT_EAGER))
def test_refuses_cuda_graphs_and_torch_compile(tmp_path, case):
    kwargs, words = NOT_EAGER[case]
    model = S.build_model(0)
    llm = S.InProcessLLM(model, vllm_config=S.fake_vllm_config(**kwargs))
    with pytest.raises(V.EagerModeRequiredError) as info:
        V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path))
    assert isinstance(info.value, ValueError) and isinstance(info.value, MsprobeError)
    msg = str(info.value)
    assert "enforce_eager=True" in msg and all(w in msg for w in words), msg
    assert_untouched(model)
    assert not tmp_path.joinpath("step0").exists()


def test_v0_style_config_without_compilation_fields():
    v0 = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False), compilation_config=None)
    assert V.eager_mode_problems(v0) == ["CUDA graphs are on (model_config.enforce_eager=False, "
                                         "vLLM captures CUDA graphs unless enforce_eager=True)"]
    assert V.eager_mode_problems(SimpleNamespace(model_config=SimpleNamespace(enforce_eager=True))) == []
    assert V.eager_mode_problems(S.fake_vllm_config(enforce_eager=True, legacy=True)) == []
    assert V.eager_mode_problems(S.fake_vllm_config(enforce_eager=False, mode=0, cudagraph_mode="NONE")) == []
    assert V.eager_mode_problems(SimpleNamespace()) is None and V.eager_mode_problems(None) is None
    assert V.check_eager_mode(None) is False and V.check_eager_mode(S.fake_vllm_config()) is True


def test_each_worker_checks_eager_mode_itself(tmp_path):
    """The engine's config here says eager, a worker's does not: the worker refuses and nothing starts."""
    model = S.build_model(0)
    worker = S.FakeWorker(0, model, S.fake_vllm_config(enforce_eager=False))
    llm = S.InProcessRpcLLM(worker, client_config=SimpleNamespace())  # nothing to check here
    with pytest.raises(V.EagerModeRequiredError, match="in worker rank 0: torch.compile is on .*CUDA graphs are on"):
        V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path))
    assert_untouched(model)


# ======================================================================================= validation
@pytest.mark.parametrize("bad", [[3, 1], [-1, 2], [1], [1, 2, 3], "1,3", [1.0, 2], [True, 2], None])
def test_dump_tokens_validates_token_range_before_touching_the_engine(tmp_path, bad):
    class Untouchable:  # stand-in LLM: any call to it fails the test
        def collective_rpc(self, *a, **k):
            raise AssertionError("the engine must not be called")

    with pytest.raises(ConfigError) as info:
        V.dump_tokens(Untouchable(), CFG, bad, dump_path=str(tmp_path))
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "token_range" in msg and repr(bad) in msg and "0 <= start <= end" in msg
    if bad is not None:
        assert isinstance(info.value, TokenRangeError)


def test_dump_tokens_validates_the_config_first(tmp_path):
    with pytest.raises(UnknownKeyError, match="did you mean 'level'"):
        V.dump_tokens(S.InProcessLLM(S.build_model(0)), {"levle": "L0"}, [1, 3], dump_path=str(tmp_path))


# ============================================================================ serialization guidance
def test_callable_needs_insecure_serialization_when_engine_is_out_of_process(tmp_path, monkeypatch):
    monkeypatch.delenv(V.INSECURE_SERIALIZATION_ENV, raising=False)
    worker = S.FakeWorker(0, S.build_model(0), S.fake_vllm_config())
    llm = S.InProcessRpcLLM(worker)
    llm.llm_engine.engine_core = S.SyncMPClient()
    with pytest.raises(ConfigError, match="VLLM_ALLOW_INSECURE_SERIALIZATION.*before LLM.*worker_extension_cls"):
        V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path))


def test_vllm_serialization_type_error_is_translated(tmp_path, monkeypatch):
    monkeypatch.delenv(V.INSECURE_SERIALIZATION_ENV, raising=False)

    class RefusingLLM:  # stand-in: vLLM's msgpack encoder refusing the callable
        llm_engine = SimpleNamespace(vllm_config=S.fake_vllm_config())

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            raise TypeError("Object of type <class 'function'> is not serializableSet "
                            "VLLM_ALLOW_INSECURE_SERIALIZATION=1 to allow fallback to pickle-based serialization.")

    with pytest.raises(ConfigError, match="'VLLM_ALLOW_INSECURE_SERIALIZATION' = None"):
        V.dump_tokens(RefusingLLM(), CFG, [1, 3], dump_path=str(tmp_path))


def test_context_manager_flushes_and_keeps_the_original_error(tmp_path):
    llm = S.InProcessLLM(S.build_model(0))
    with pytest.raises(KeyError, match="boom"):
        with V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path)) as session:
            llm.generate()
            raise KeyError("boom")
    assert session.finished
    assert_three_decode_passes(load_dump(session.rank_dirs[0]))


# =================================================================== V1: workers in real subprocesses
def test_v1_workers_in_subprocesses_one_rank_folder_each(tmp_path, monkeypatch):
    monkeypatch.delenv(V.INSECURE_SERIALIZATION_ENV, raising=False)
    with S.MultiprocLLM(world_size=2) as llm:
        with pytest.raises(ConfigError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
            V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path))
        monkeypatch.setenv(V.INSECURE_SERIALIZATION_ENV, "1")
        session = V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path))
        assert session.route == "collective_rpc"
        assert [w["rank"] for w in session.workers] == [0, 1]
        assert [w["pid"] for w in session.workers] == llm.worker_pids and os.getpid() not in llm.worker_pids
        assert llm.generate() == REFERENCE
        assert session.finish() == [str(tmp_path / "step0" / "rank0"), str(tmp_path / "step0" / "rank1")]
    for rank in (0, 1):
        assert_three_decode_passes(load_dump(tmp_path / "step0" / f"rank{rank}"))
    assert sorted(p.name for p in (tmp_path / "step0").iterdir()) == ["rank0", "rank1"]
    assert PrecisionDebugger.current() is None  # nothing was started in this process


def test_v1_worker_extension_without_pickling_two_generations(tmp_path, monkeypatch):
    monkeypatch.delenv(V.INSECURE_SERIALIZATION_ENV, raising=False)
    with S.MultiprocLLM(world_size=2, with_extension=True) as llm:
        for step in (0, 1):
            with V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path)) as session:
                assert session.route == "extension"
                assert llm.generate() == REFERENCE
            assert session.rank_dirs == [str(tmp_path / f"step{step}" / f"rank{r}") for r in (0, 1)]
    for step in (0, 1):
        for rank in (0, 1):
            assert_three_decode_passes(load_dump(tmp_path / f"step{step}" / f"rank{rank}"))


# ================================================================================= core behaviour
def test_out_of_forward_work_is_dumped_for_every_token_or_for_none(tmp_path):
    llm = S.InProcessLLM(S.build_model(0))
    with V.dump_tokens(llm, CFG, [1, 3], dump_path=str(tmp_path)) as session:
        llm.generate()
    lm_head = forward_indices(load_dump(session.rank_dirs[0]), "Module.lm_head.Linear")
    assert len(lm_head) in (0, 3), lm_head


# ========================================================================================== recipe
def test_vllm_recipe_help_and_clear_exit_without_vllm(tmp_path):
    recipe = ROOT / "recipes" / "vllm_token_range.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    shown = subprocess.run([sys.executable, str(recipe), "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "--token-range" in shown.stdout and "enforce_eager" in shown.stdout
    run = subprocess.run([sys.executable, str(recipe), "--dump-path", str(tmp_path / "d")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 2
    assert "vLLM is not installed" in run.stderr and "GPU" in run.stderr
    assert not (tmp_path / "d").exists()
