"""``dump_tokens`` refuses vLLM's own V1 engine created without ``enforce_eager=True``: on the CPU vLLM then
compiles the model with torch.compile (``compilation_config.mode`` DYNAMO_TRACE_ONCE), which would bypass the
Python hooks. The refusal comes before anything reaches a worker, and every worker refuses on its own too.
Run by ``make test-vllm`` (``.venv-vllm``); deselected in the default run.
"""

from __future__ import annotations

import pytest

import vllm_real as R
from msprobe_core.errors import MsprobeError
from msprobe_integrations import vllm as V

pytestmark = pytest.mark.vllm_real

L0 = {"task": "statistics", "level": "L0"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with R.running_engine(tmp_path_factory.mktemp("tiny_llama"), extension=True, insecure=True,
                          enforce_eager=False) as e:
        yield e


@pytest.mark.parametrize("route", ["auto", "extension", "collective_rpc", "apply_model"])
def test_engine_not_in_eager_mode_is_refused_and_nothing_is_written(engine, tmp_path, route):
    with pytest.raises(V.EagerModeRequiredError) as info:
        V.dump_tokens(engine.llm, L0, [1, 3], dump_path=str(tmp_path), route=route)
    assert isinstance(info.value, MsprobeError)
    msg = str(info.value)
    assert "torch.compile is on (compilation_config.mode=" in msg and "enforce_eager=True" in msg, msg
    assert "llm.llm_engine.vllm_config" in msg  # refused here, before any worker was called
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    assert R.generate(engine.llm) == engine.one  # the engine goes on as before


def test_each_worker_refuses_by_itself(engine, tmp_path):
    [answer] = engine.llm.collective_rpc("msprobe_start", args=(L0, [1, 3], str(tmp_path)))
    assert answer["ok"] is False and answer["kind"] == "eager" and answer["where"] == "worker rank 0"
    assert any("torch.compile is on" in r for r in answer["reasons"])
    assert not any(tmp_path.iterdir())
