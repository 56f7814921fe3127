"""``dump_tokens`` on vLLM's own V1 engine kept in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the
engine core and its one worker run here, so the model is reachable by attribute (route ``in_process``,
msprobe's documented path) as well as through ``collective_rpc`` and ``apply_model``, and nothing is
serialized. Scheduling is deterministic here: two prompts are prefilled in one engine step.
Run by ``make test-vllm`` (``.venv-vllm``); deselected in the default run.
"""

from __future__ import annotations

import os

import pytest

import vllm_real as R
from msprobe_integrations import vllm as V

pytestmark = pytest.mark.vllm_real


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with R.running_engine(tmp_path_factory.mktemp("tiny_llama"), in_process=True, extension=False) as e:
        yield e


@pytest.mark.parametrize("route, chosen", [("auto", "collective_rpc"), ("in_process", "in_process"),
                                           ("apply_model", "apply_model")])
@pytest.mark.parametrize("level", ["L0", "mix"])
def test_in_process_routes_write_the_records_of_the_range(engine, tmp_path, route, chosen, level):
    session = V.dump_tokens(engine.llm, {"task": "statistics", "level": level}, [0, 1], dump_path=str(tmp_path),
                            route=route)
    assert session.route == chosen
    assert [(w["rank"], w["pid"]) for w in session.workers] == [(0, os.getpid())]
    tokens, [passes] = R.counted_generation(engine.llm, R.PROMPTS)
    assert tokens == engine.two
    assert session.finish() == [str(tmp_path / "step0" / "rank0")]  # vLLM's torch.distributed rank
    # deterministic batching here: both prompts in the prefill, then one token of each per step
    assert [p["tokens"] for p in passes] == [11, 2, 2, 2, 2]
    data = R.load_data(tmp_path / "step0" / "rank0")
    assert R.module_records(data) == R.expected_module_records(passes, 0, 1)
    assert R.embedding_inputs(data) == [11, 2]
    assert bool(R.api_records(data)) == (level == "mix")
