"""token_range with Hugging Face ``generate()``: a real transformers Llama built from a config, greedy
decoding with a KV cache. Forward call 0 is the prefill, call k the decode step that produces token k."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from msprobe_core.errors import ConfigError, TokenRangeError
from msprobe_core.pytorch import PrecisionDebugger

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
PROMPT_LEN = 6
MAX_NEW = 5
ORIGINAL_LINEAR = torch.nn.functional.linear
MODULE_KEY = re.compile(r"^(Module\..+)\.forward\.(\d+)$")


@pytest.fixture(scope="module")
def llama():
    """(model, prompt, tokens generated without any dump)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 1000, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    return model, prompt, generate(model, prompt)


def generate(model, prompt):
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW, do_sample=False,
                          use_cache=True, pad_token_id=0)


def dump_generation(model, prompt, dump_path, level, token_range):
    """Generate under a token_range dump; (tokens, dump.json data or None)."""
    debugger = PrecisionDebugger({"task": "statistics", "dump_path": str(dump_path), "level": level})
    debugger.start(model=model, token_range=token_range)
    out = generate(model, prompt)
    debugger.stop()
    debugger.step()
    files = sorted(Path(dump_path).glob("step*/*/dump.json"))
    assert len(files) <= 1, files
    return out, (json.loads(files[0].read_text())["data"] if files else None)


def module_calls(data) -> dict[str, list[int]]:
    """Module base name -> its forward call indices (L0 naming ``Module.{path}.{Class}.forward.{n}``)."""
    calls = defaultdict(list)
    for key in data:
        m = MODULE_KEY.match(key)
        if m:
            calls[m.group(1)].append(int(m.group(2)))
    return {k: sorted(v) for k, v in calls.items()}


def api_calls(data, api: str) -> list[str]:
    return sorted((k for k in data if k.startswith(f"{api}.") and k.endswith(".forward")),
                  key=lambda k: int(k.split(".")[-2]))


# ==================================================================================== the window
@pytest.mark.parametrize("level", ["L0", "L1", "mix"])
def test_token_range_1_3_dumps_exactly_the_three_decode_steps(llama, tmp_path, level):
    model, prompt, reference = llama
    out, data = dump_generation(model, prompt, tmp_path, level, [1, 3])
    assert torch.equal(out, reference), "the dump changed the generated tokens"
    assert data is not None

    if level in ("L0", "mix"):
        calls = module_calls(data)
        # every submodule of this Llama runs once per forward pass: three passes, numbered 0, 1, 2
        assert len(calls) == 31 and all(v == [0, 1, 2] for v in calls.values()), calls
        for n in range(3):  # decode steps: one new token in, not the 6-token prompt
            assert data[f"Module.model.embed_tokens.Embedding.forward.{n}"]["input_args"][0]["shape"] == [1, 1]
            assert data[f"Module.lm_head.Linear.forward.{n}"]["output"][0]["shape"] == [1, 1, 1000]
    else:
        assert not module_calls(data)

    if level in ("L1", "mix"):
        embedding = api_calls(data, "Functional.embedding")
        assert embedding == [f"Functional.embedding.{n}.forward" for n in range(3)]
        assert all(data[k]["input_args"][0]["shape"] == [1, 1] for k in embedding)
        # per pass: 2 layers x (q, k, v, o, gate, up, down) + lm_head = 15 linears, 2 attentions
        assert len(api_calls(data, "Functional.linear")) == 3 * 15
        assert len(api_calls(data, "Functional.scaled_dot_product_attention")) == 3 * 2
    else:
        assert not [k for k in data if not k.startswith("Module.")]
    assert torch.nn.functional.linear is ORIGINAL_LINEAR and not model._forward_pre_hooks and not model._forward_hooks


def test_token_range_0_0_dumps_only_the_prefill(llama, tmp_path):
    model, prompt, reference = llama
    out, data = dump_generation(model, prompt, tmp_path, "mix", [0, 0])
    assert torch.equal(out, reference)
    assert all(v == [0] for v in module_calls(data).values())
    assert data["Module.model.embed_tokens.Embedding.forward.0"]["input_args"][0]["shape"] == [1, PROMPT_LEN]
    assert api_calls(data, "Functional.embedding") == ["Functional.embedding.0.forward"]


def test_token_range_past_the_generation_dumps_nothing(llama, tmp_path):
    model, prompt, reference = llama
    out, data = dump_generation(model, prompt, tmp_path, "mix", (MAX_NEW, MAX_NEW + 3))
    assert torch.equal(out, reference)
    assert data is None and not any(tmp_path.rglob("dump.json"))


def test_last_token_window_and_tuple_range(llama, tmp_path):
    model, prompt, reference = llama
    out, data = dump_generation(model, prompt, tmp_path, "L0", (MAX_NEW - 1, MAX_NEW + 10))  # ends past the last call
    assert torch.equal(out, reference)
    assert all(v == [0] for v in module_calls(data).values())
    assert data["Module.model.embed_tokens.Embedding.forward.0"]["input_args"][0]["shape"] == [1, 1]


# ==================================================================================== validation
@pytest.mark.parametrize("bad", [[3, 1], [-1, 2], [1], [1, 2, 3], "1,3", [1.0, 2], [True, 2], (1, None), 5, {1: 3}])
def test_bad_token_range_is_a_clear_value_error(llama, tmp_path, bad):
    model, _, _ = llama
    debugger = PrecisionDebugger({"task": "statistics", "dump_path": str(tmp_path), "level": "mix"})
    with pytest.raises(TokenRangeError) as info:
        debugger.start(model=model, token_range=bad)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ConfigError)
    msg = str(info.value)
    assert "'token_range'" in msg and repr(bad) in msg and "two ints" in msg and "0 <= start <= end" in msg, msg
    # nothing was installed or written
    assert torch.nn.functional.linear is ORIGINAL_LINEAR and not model._forward_pre_hooks
    assert not any(tmp_path.iterdir())


def test_token_range_needs_a_model(tmp_path):
    debugger = PrecisionDebugger({"task": "statistics", "dump_path": str(tmp_path), "level": "L1"})
    with pytest.raises(ConfigError, match="'model' = None.*token_range counts the model's forward calls"):
        debugger.start(token_range=[1, 3])


# ================================================================================== core behaviour
def test_work_between_forward_passes_is_dumped_for_every_token_or_for_none(llama, tmp_path):
    model, prompt, _ = llama
    _, data = dump_generation(model, prompt, tmp_path, "L1", [1, 3])
    assert len(api_calls(data, "Torch.argmax")) in (0, 3)


def test_plain_dump_after_a_token_range_dump_records(llama, tmp_path):
    model, prompt, _ = llama
    debugger = PrecisionDebugger({"task": "statistics", "dump_path": str(tmp_path), "level": "L0"})
    debugger.start(model=model, token_range=[1, 1])
    generate(model, prompt)
    debugger.stop()
    debugger.step()
    debugger.start(model=model)
    model(prompt)
    debugger.stop()
    debugger.step()
    assert (tmp_path / "step0").is_dir()
    assert (tmp_path / "step1").is_dir(), "the second step dumped nothing"


# ========================================================================================== recipe
def test_hf_recipe_help_and_default_run(tmp_path):
    recipe = ROOT / "recipes" / "hf_generate_token_range.py"
    shown = subprocess.run([sys.executable, str(recipe), "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "--token-range" in shown.stdout
    run = subprocess.run([sys.executable, str(recipe), "--dump-path", str(tmp_path / "d")], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads(run.stdout)
    assert summary["forward_passes_dumped"] == 3 and summary["tokens_identical"] is True
    assert Path(summary["dump"]).is_file() and summary["level"] == "mix"
    bad = subprocess.run([sys.executable, str(recipe), "--token-range", "3", "1", "--dump-path", str(tmp_path / "e")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "'token_range' = [3, 1]" in bad.stderr
