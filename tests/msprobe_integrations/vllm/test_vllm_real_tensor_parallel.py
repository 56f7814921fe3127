"""``dump_tokens`` on vLLM's own V1 engine with tensor parallel 2 on the CPU: two worker processes (gloo), one
core each (``VLLM_CPU_OMP_THREADS_BIND="0|1"``; without it vLLM refuses two workers on one NUMA node). The engine
is created the secure way: msprobe's worker extension and NO ``VLLM_ALLOW_INSECURE_SERIALIZATION``, so no
function can be sent to the workers (and none of this module's checks counts calls inside them).
Run by ``make test-vllm`` (``.venv-vllm``); deselected in the default run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vllm_real as R
from msprobe_core.cli import main as msprobe_main
from msprobe_core.errors import ConfigError
from msprobe_integrations import vllm as V

pytestmark = pytest.mark.vllm_real

L0 = {"task": "statistics", "level": "L0"}
QKV = "Module.model.layers.0.self_attn.qkv_proj.QKVParallelLinear.forward.0"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with R.running_engine(tmp_path_factory.mktemp("tiny_llama"), extension=True, insecure=False,
                          tensor_parallel_size=2) as e:
        yield e


def test_two_ranks_each_write_the_range(engine, tmp_path):
    with V.dump_tokens(engine.llm, L0, [1, 3], dump_path=str(tmp_path)) as session:
        assert session.route == "extension"
        assert R.generate(engine.llm) == engine.one
    assert [w["rank"] for w in session.workers] == [0, 1]
    assert len({w["pid"] for w in session.workers}) == 2
    assert session.rank_dirs == [str(tmp_path / "step0" / f"rank{r}") for r in (0, 1)]
    rank0, rank1 = (R.load_data(d) for d in session.rank_dirs)
    assert R.module_records(rank0) == R.module_records(rank1)
    assert R.embedding_inputs(rank0) == R.embedding_inputs(rank1) == [1, 1, 1]
    # every module once per pass (the rotary embedding, shared by both layers, twice)
    assert set(R.module_records(rank0).values()) == {3, 6}
    # each rank computes its share of the attention projection: 1 of the 2 query heads, the one key/value head
    # replicated (2 x 64 + 64 = 192 outputs instead of 256)
    assert [d[QKV]["output"][0]["shape"] for d in (rank0, rank1)] == [[1, 192], [1, 192]]
    # vLLM's CPU linear layers hand their weight to a packed oneDNN kernel and keep an empty parameter
    assert [d[QKV]["parameters"]["weight"]["shape"] for d in (rank0, rank1)] == [[0], [0]]


def test_config_rank_list_keeps_one_rank(engine, tmp_path):
    with V.dump_tokens(engine.llm, {**L0, "rank": [1]}, [0, 0], dump_path=str(tmp_path)) as session:
        assert R.generate(engine.llm) == engine.one
    assert session.rank_dirs == [str(tmp_path / "step0" / "rank1")]
    assert sorted(p.name for p in (tmp_path / "step0").iterdir()) == ["rank1"]
    assert R.embedding_inputs(R.load_data(session.rank_dirs[0])) == [len(R.PROMPTS[0])]


def test_both_ranks_compare_equal_across_two_runs(engine, tmp_path):
    for run in ("a", "b"):
        with V.dump_tokens(engine.llm, L0, [0, 2], dump_path=str(tmp_path / run)):
            assert R.generate(engine.llm) == engine.one
    out = tmp_path / "compare"
    assert msprobe_main(["compare", "-t", str(tmp_path / "a"), "-g", str(tmp_path / "b"), "-o", str(out)]) == 0
    pairs = json.loads((out / "compare_summary.json").read_text())["pairs"]
    assert [p["rank"] for p in pairs] == ["rank0", "rank1"]
    assert all(p["rows"]["error"] == p["rows"]["unmatched"] == 0 and p["rows"]["pass"] > 0 for p in pairs), pairs


def test_pickled_routes_are_refused_clearly_without_insecure_serialization(engine, tmp_path):
    for route in ("collective_rpc", "apply_model"):
        with pytest.raises(ConfigError, match="VLLM_ALLOW_INSECURE_SERIALIZATION.*worker_extension_cls"):
            V.dump_tokens(engine.llm, L0, [1, 3], dump_path=str(tmp_path), route=route)
    # what dump_tokens spares the user: vLLM's own encoder refuses the function with a TypeError, which the
    # integration turns into the same advice when it gets that far
    args = (L0, [1, 3], str(tmp_path))
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        engine.llm.collective_rpc(V.worker_start, args=args)
    with pytest.raises(ConfigError, match="'VLLM_ALLOW_INSECURE_SERIALIZATION' = None.*before LLM"):
        V.client._collective_rpc(engine.llm, V.worker_start, args)
    assert not any(tmp_path.iterdir())
    assert R.generate(engine.llm) == engine.one


@pytest.mark.parametrize("level", ["L1", "mix"])
def test_api_levels_leave_the_tokens_unchanged(engine, tmp_path, level):
    """L1 and mix with tensor parallel 2: the vocab-parallel embedding calls vLLM's ``torch.compile``d
    ``get_masked_input_and_mask`` while the dump's operator mode is on; Dynamo must neither trace the mode nor
    change what the compiled function computes: the tokens are those of the run without the tool."""
    with V.dump_tokens(engine.llm, {"task": "statistics", "level": level}, [1, 3], dump_path=str(tmp_path)) as session:
        assert R.generate(engine.llm) == engine.one
    assert session.rank_dirs == [str(tmp_path / "step0" / f"rank{r}") for r in (0, 1)]
    for rank_dir in session.rank_dirs:
        data = R.load_data(rank_dir)
        assert R.api_records(data), rank_dir
        assert not list(Path(rank_dir).rglob("dump_error_info.log"))
    assert R.generate(engine.llm) == engine.one  # and after the dump
