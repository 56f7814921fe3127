"""Dump only the forward passes that produce tokens START..END of a Hugging Face ``generate()`` (msprobe's
``token_range``).

A small Llama is built from a config (nothing is downloaded) unless ``--model`` names a local model. The
generation runs greedily with a KV cache twice, without and then with the dump; the recipe prints what
was dumped and checks that the generated tokens are identical. Forward call 0 is the prefill, call k the
decode step that produces token k.

    python recipes/hf_generate_token_range.py                       # tokens 1..3: three decode steps, mix level
    python recipes/hf_generate_token_range.py --token-range 0 0     # the prefill only
    python recipes/hf_generate_token_range.py --level L1 --dump-path /tmp/my_dump

The same three lines work in any script (see ``main``)::

    debugger = PrecisionDebugger(config_path="config.json")
    debugger.start(model=model, token_range=[1, 3])
    model.generate(...); debugger.stop(); debugger.step()
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from a checkout without installing the package
    sys.path.insert(0, str(ROOT))


def add_dump_options(p: argparse.ArgumentParser, passes: str) -> None:
    """``--token-range``, ``--level``, ``--task``: what a token_range recipe dumps (``passes``: what START..END
    count). The vLLM recipe uses it too."""
    p.add_argument("--token-range", nargs=2, type=int, default=[1, 3], metavar=("START", "END"),
                   help=f"{passes} to dump, 0 = the prefill (default: 1 3)")
    p.add_argument("--level", choices=["L0", "L1", "mix"], default="mix", help="dump level (default: mix)")
    p.add_argument("--task", choices=["statistics", "tensor", "structure"], default="statistics",
                   help="dump task (default: statistics)")


def checked_dump_path(args: argparse.Namespace, default_root: str) -> Optional[str]:
    """Check ``--token-range`` (a bad one exits with status 2 and msprobe's message) and return the dump path:
    ``--dump-path``; None with ``--config`` (its own dump_path wins); else a new folder under ``default_root``.
    The vLLM recipe uses it too."""
    from msprobe_core.dump.config import validate_token_range
    from msprobe_core.errors import MsprobeError

    try:
        validate_token_range(args.token_range)
    except MsprobeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.dump_path is None and not args.config:
        return str(Path(default_root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    return args.dump_path


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Output: DUMP_PATH/step0/proc{pid}/dump.json (rank{R} under torch.distributed).")
    add_dump_options(p, "forward passes")
    p.add_argument("--max-new-tokens", type=int, default=5, help="tokens to generate (default: 5)")
    p.add_argument("--config", help="an msprobe config.json instead of --level/--task (--dump-path still overrides it)")
    p.add_argument("--dump-path", help="where to dump (default: a new folder under ./hf_token_range_dump)")
    p.add_argument("--model", help="a local Hugging Face causal LM folder (default: a tiny Llama built from a config)")
    p.add_argument("--prompt-len", type=int, default=6, help="random prompt length in tokens (default: 6)")
    p.add_argument("--seed", type=int, default=0, help="seed for the model weights and the prompt (default: 0)")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model)
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=4))
    return model.eval()


def forward_passes(data: dict[str, Any]) -> list[int]:
    """The forward-pass indices in a dump: calls of the token embedding (it runs once per forward pass)."""
    found = set()
    for key in data:
        m = re.match(r"^Module\.(?:.*\.)?embed_tokens\.[^.]+\.forward\.(\d+)$", key) or \
            re.match(r"^Functional\.embedding\.(\d+)\.forward$", key)
        if m:
            found.add(int(m.group(1)))
    return sorted(found)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    from msprobe_core.errors import MsprobeError
    from msprobe_core.pytorch import PrecisionDebugger

    dump_path = checked_dump_path(args, "hf_token_range_dump")  # fails fast, before the model is built
    start, end = args.token_range
    model = build_model(args)
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=generator)
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, use_cache=True,
                      attention_mask=torch.ones_like(prompt), pad_token_id=0)

    t0 = time.perf_counter()
    reference = model.generate(prompt, **gen_kwargs)
    plain_s = time.perf_counter() - t0

    try:
        debugger = PrecisionDebugger(config_path=args.config, task=None if args.config else args.task,
                                     level=None if args.config else args.level, dump_path=dump_path)
        debugger.start(model=model, token_range=[start, end])
    except MsprobeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    output = model.generate(prompt, **gen_kwargs)
    dumped_s = time.perf_counter() - t0
    debugger.stop()
    debugger.step()

    files = sorted(Path(debugger.config.dump_path).glob("step0/*/dump.json"))
    data = json.loads(files[0].read_text())["data"] if files else {}
    passes = forward_passes(data)
    calls = args.max_new_tokens  # one forward per new token: the prefill, then max_new_tokens - 1 decode steps
    expected = max(0, min(end, calls - 1) - start + 1)
    same = torch.equal(output, reference)
    summary = {
        "token_range": [start, end],
        "level": debugger.config.level,
        "dump": str(files[0]) if files else None,
        "records": len(data),
        "forward_passes_dumped": len(passes),
        "forward_passes_expected": expected,
        "tokens_identical": same,
        "generate_seconds": {"plain": round(plain_s, 3), "with_dump": round(dumped_s, 3)},
    }
    print(json.dumps(summary, indent=2))
    return 0 if same and len(passes) == expected else 1


if __name__ == "__main__":
    sys.exit(main())
