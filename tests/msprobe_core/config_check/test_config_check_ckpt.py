"""Checkpoint compare: layouts (Hugging Face, Megatron TP/PP/EP/virtual pipeline, megatron-core torch_dist,
DeepSpeed ZeRO-2/3), the Megatron -> Hugging Face mapping, metrics, output rules.

The slow tests use real checkpoints written by ``tests/support/config_check_ckpt_writer.py`` under torchrun:
megatron-core GPT models re-sharded by megatron-core itself from one set of weights (TP=1, TP=2 with two
gloo processes, PP=2 x virtual pipeline 2) and DeepSpeed engines' ``save_checkpoint``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dist_run import torchrun
from msprobe_core.cli import main as cli_main
from msprobe_core.config_check.ckpt.compare import compare_checkpoints
from msprobe_core.config_check.ckpt.layout import open_checkpoint
from msprobe_core.config_check.ckpt.mapping import apply_rules, load_rules
from msprobe_core.config_check.ckpt.metrics import similarity
from msprobe_core.config_check.exceptions import CheckpointError, PackPathError
from msprobe_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
WRITER = ROOT / "tests" / "support" / "config_check_ckpt_writer.py"


def _differing(result: dict) -> dict:
    return {k: v for k, v in result.items() if v["l2"] != 0.0 or v["cos"] != 1.0}


# ================================================================================ metrics
def test_metrics():
    a = torch.tensor([3.0, 4.0])
    assert similarity(a, a.clone()) == (0.0, 1.0)
    l2, cos = similarity(a, torch.tensor([4.0, 3.0]))
    assert l2 == pytest.approx(2 ** 0.5) and cos == pytest.approx(24 / 25)
    assert similarity(a, -a)[1] == pytest.approx(-1.0)
    assert similarity(torch.zeros(3), torch.ones(3)) == (pytest.approx(3 ** 0.5), None)
    big = torch.randn(3 * (1 << 22) + 5)  # several chunks
    assert similarity(big, big.to(torch.float64)) == (0.0, 1.0)
    l2, cos = similarity(big, big + 1e-3)
    assert l2 == pytest.approx(1e-3 * big.numel() ** 0.5, rel=1e-4)


# ================================================================================ Hugging Face
def _hf_model(folder: Path, state: dict, shards: int) -> None:
    folder.mkdir(parents=True)
    names, weight_map = list(state), {}
    for s in range(shards):
        part = {k: state[k].contiguous() for k in names[s::shards]}
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(24, 16, generator=g) for i in range(3)}
    state["model.embed_tokens.weight"] = torch.randn(50, 16, generator=g).to(torch.bfloat16)
    return state


def test_hf_sharded_safetensors_against_a_bin_file(tmp_path):
    state = _state()
    _hf_model(tmp_path / "a", state, shards=3)
    other = dict(state)
    other["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"] * 1.01
    torch.save(other, tmp_path / "pytorch_model.bin")
    out = tmp_path / "sim.json"
    assert cli_main(["config_check", "-f", "pytorch", "--compare", str(tmp_path / "a"),
                     str(tmp_path / "pytorch_model.bin"), "-o", str(out), "-q"]) == 0
    result = json.loads(out.read_text())
    assert set(result) == set(state)
    assert set(_differing(result)) == {"model.layers.1.mlp.up_proj.weight"}
    rec = result["model.layers.1.mlp.up_proj.weight"]
    assert set(rec) == {"l2", "cos", "numel", "shape"} and rec["numel"] == 24 * 16 and rec["shape"] == [24, 16]
    assert rec["l2"] == pytest.approx(0.01 * float(state["model.layers.1.mlp.up_proj.weight"].norm()), rel=1e-5)
    assert rec["cos"] == pytest.approx(1.0)
    # an existing output is an error, and left as it was
    before = out.read_text()
    assert cli_main(["config_check", "--compare", str(tmp_path / "a"), str(tmp_path / "a"), "-o", str(out)]) == 2
    assert out.read_text() == before


def test_one_sided_names_shapes_and_vocabulary_padding(tmp_path):
    a, b = _state(), _state()
    b["model.embed_tokens.weight"] = torch.cat([a["model.embed_tokens.weight"], torch.zeros(14, 16, dtype=torch.bfloat16)])
    b["model.layers.0.mlp.up_proj.weight"] = torch.randn(16, 24)
    del b["model.layers.2.mlp.up_proj.weight"]
    b["extra.bias"] = torch.ones(3)
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    result = compare_checkpoints(tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "o.json",
                                 progress=False)
    emb = result["model.embed_tokens.weight"]
    assert (emb["l2"], emb["cos"]) == (0.0, 1.0) and "first 50 compared" in emb["note"]
    assert result["model.layers.0.mlp.up_proj.weight"]["l2"] is None
    assert "shape differs" in result["model.layers.0.mlp.up_proj.weight"]["note"]
    assert "only in" in result["model.layers.2.mlp.up_proj.weight"]["note"]
    assert result["extra.bias"]["note"].startswith("only in") and result["extra.bias"]["shape"] == [3]
    assert json.loads((tmp_path / "o.json").read_text()) == result


def test_paths_that_are_not_whole_checkpoints(tmp_path):
    rank = tmp_path / "iter_0000001" / "mp_rank_00"
    rank.mkdir(parents=True)
    torch.save({"model": {"w": torch.ones(2)}}, rank / "model_optim_rng.pt")
    with pytest.raises(CheckpointError, match="one rank's shard"):
        open_checkpoint(rank)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="found: notes.txt"):
        open_checkpoint(tmp_path / "junk")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(CheckpointError, match="iter_0000007"):
        open_checkpoint(tmp_path)
    bad = tmp_path / "rules.yaml"
    bad.write_text("rules:\n  - {megatron: a, hf: [b, c], split: glu3}\n")
    with pytest.raises(ConfigError, match="split"):
        load_rules(bad)
    with pytest.raises(PackPathError, match="already exists"):
        compare_checkpoints(tmp_path, tmp_path, bad)


# ================================================================================ Megatron layouts (synthetic)
def _megatron_file(folder: Path, model: dict, args: argparse.Namespace, key: str = "model") -> None:
    folder.mkdir(parents=True)
    torch.save({key: model, "args": args, "iteration": 3, "checkpoint_version": 3.0,
                "rng_state": [{"random_rng_state": ("x", 1)}]}, folder / "model_optim_rng.pt")


def test_expert_parallel_shards_renumber_experts(tmp_path):
    """EP=2 (folders mp_rank_00_000/_001: with PP=1 the second number is the expert rank), 4 experts."""
    g = torch.Generator().manual_seed(0)
    dense = {"decoder.layers.0.self_attention.linear_proj.weight": torch.randn(8, 8, generator=g),
             "decoder.layers.0.mlp.router.weight": torch.randn(4, 8, generator=g)}
    experts = {j: torch.randn(16, 8, generator=g) for j in range(4)}
    full = dict(dense, **{f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc1.weight": w
                          for j, w in experts.items()})
    args = argparse.Namespace(pipeline_model_parallel_size=1, expert_model_parallel_size=1, tensor_model_parallel_size=1)
    _megatron_file(tmp_path / "ref" / "iter_0000003" / "mp_rank_00", full, args)
    ep_args = argparse.Namespace(pipeline_model_parallel_size=1, expert_model_parallel_size=2, tensor_model_parallel_size=1)
    for ep in range(2):
        local = dict(dense, **{f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc1.weight": experts[2 * ep + j]
                               for j in range(2)})
        _megatron_file(tmp_path / "ep2" / "iter_0000003" / f"mp_rank_00_{ep:03d}", local, ep_args)
    (tmp_path / "ep2" / "latest_checkpointed_iteration.txt").write_text("3")
    result = compare_checkpoints(tmp_path / "ref" / "iter_0000003", tmp_path / "ep2", tmp_path / "o.json",
                                 progress=False)
    assert set(result) == set(full) and _differing(result) == {}


def test_legacy_megatron_names_with_tensor_and_pipeline_parallelism(tmp_path):
    """megatron.legacy names, TP=2 x PP=2 folders (mp_rank_TT_PPP), split dims from the layer kind."""
    g = torch.Generator().manual_seed(0)
    layers = [{"input_norm.weight": torch.randn(8, generator=g),
               "self_attention.query_key_value.weight": torch.randn(24, 8, generator=g),
               "self_attention.dense.weight": torch.randn(8, 8, generator=g),
               "mlp.dense_h_to_4h.weight": torch.randn(16, 8, generator=g),
               "mlp.dense_4h_to_h.weight": torch.randn(8, 16, generator=g)} for _ in range(4)]
    dims = {"input_norm.weight": None, "self_attention.query_key_value.weight": 0, "self_attention.dense.weight": 1,
            "mlp.dense_h_to_4h.weight": 0, "mlp.dense_4h_to_h.weight": 1}
    prefix = "language_model.encoder.layers."
    full = {f"{prefix}{i}.{k}": v for i, layer in enumerate(layers) for k, v in layer.items()}
    args = argparse.Namespace(pipeline_model_parallel_size=1, tensor_model_parallel_size=1, swiglu=False)
    _megatron_file(tmp_path / "ref" / "mp_rank_00", full, args)
    args = argparse.Namespace(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, swiglu=False)
    for tp in range(2):
        for pp in range(2):
            local = {}
            for i in range(2):
                for k, v in layers[2 * pp + i].items():
                    local[f"{prefix}{i}.{k}"] = v if dims[k] is None else v.chunk(2, dim=dims[k])[tp]
            _megatron_file(tmp_path / "tp2pp2" / f"mp_rank_{tp:02d}_{pp:03d}", local, args)
    result = compare_checkpoints(tmp_path / "ref", tmp_path / "tp2pp2", tmp_path / "o.json", progress=False)
    assert set(result) == set(full) and _differing(result) == {}


# ================================================================================ real checkpoints (slow)
@pytest.fixture(scope="module")
def megatron_ckpts(tmp_path_factory):
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("megatron_ckpts")
    torchrun(WRITER, "reference", str(out), nproc=1, cwd=ROOT, timeout=400)
    torchrun(WRITER, "parallel", str(out), nproc=2, cwd=ROOT, timeout=400)
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("other", ["tp2", "pp2vpp2", "dist_tp1", "dist_tp2"])
def test_megatron_parallel_layouts_equal_the_tp1_checkpoint(megatron_ckpts, tmp_path, other):
    """The same weights saved with TP=2 (two gloo ranks), PP=2 x VPP=2, or as torch_dist compare as identical."""
    result = compare_checkpoints(megatron_ckpts / "tp1", megatron_ckpts / other, tmp_path / "o.json", progress=False)
    assert len(result) == 27 and _differing(result) == {}
    assert result["decoder.layers.3.mlp.linear_fc1.weight"]["shape"] == [96, 32]  # swiglu: 2 x ffn 48
    assert result["decoder.layers.3.self_attention.linear_qkv.weight"]["shape"] == [64, 32]  # 4 heads, 2 groups


@pytest.mark.slow
@pytest.mark.distributed
def test_megatron_perturbed_layer_shows_only_in_its_parameter(megatron_ckpts, tmp_path):
    result = compare_checkpoints(megatron_ckpts / "tp2", megatron_ckpts / "tp1_perturbed", tmp_path / "o.json",
                                 progress=False)
    diff = _differing(result)
    assert set(diff) == {"decoder.layers.2.mlp.linear_fc2.weight"}
    assert diff["decoder.layers.2.mlp.linear_fc2.weight"]["l2"] == pytest.approx(1e-3 * (32 * 48) ** 0.5, rel=1e-3)


@pytest.mark.slow
@pytest.mark.distributed
def test_megatron_against_its_hugging_face_conversion(megatron_ckpts, tmp_path):
    """The shipped mapping turns the Megatron checkpoint into Llama weights that give Megatron's logits;
    saved as sharded safetensors, that conversion compares as identical to the TP=2 checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    megatron = open_checkpoint(megatron_ckpts / "tp1")
    view = apply_rules(megatron, load_rules(), megatron.config)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=16,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict({name: e.load() for name, e in view.entries.items()}, strict=True)
    ref = torch.load(megatron_ckpts / "logits.pt")
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    result = compare_checkpoints(megatron_ckpts / "tp2", tmp_path / "hf", tmp_path / "o.json", progress=False)
    assert len(result) == 39 and _differing(result) == {}  # q/k/v and gate/up split: 27 + 4 x 3
    assert "model.layers.3.self_attn.k_proj.weight" in result


@pytest.mark.slow
def test_deepspeed_zero2_and_zero3_checkpoints(tmp_path):
    pytest.importorskip("deepspeed")
    torchrun(WRITER, "deepspeed", str(tmp_path), nproc=1, cwd=ROOT, timeout=400)
    for stage in (2, 3):
        result = compare_checkpoints(tmp_path / f"ds_zero{stage}", tmp_path / f"ds_zero{stage}.pt",
                                     tmp_path / f"o{stage}.json", progress=False)
        assert set(result) == {"0.weight", "0.bias", "2.weight", "2.bias"} and _differing(result) == {}, stage
