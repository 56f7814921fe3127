"""config_check: find what differs between two training setups before comparing numbers.

- Static collection (``python -m msprobe_core config_check -f pytorch -d run.sh conf.yaml -o pack.zip``):
  environment variables, installed package versions and the hyperparameters of launch scripts and
  config files (``collect``, ``shell_script``, ``config_files``).
- Dynamic collection (``ConfigChecker.apply_patches()`` then ``ConfigChecker(model, ...)``): per rank and
  micro-step the weights, the batches, the random-number call sites, Megatron's arguments (``checker``).
- Compare (``config_check -c BENCH.zip CMP.zip -o OUT``): ``OUT/result.xlsx`` with a summary and one
  sheet per check (``compare``, ``checks``).
- Checkpoint compare (``config_check --compare CKPT_A CKPT_B -o ckpt_similarity.json``): per parameter
  L2 distance and cosine similarity of Megatron-LM/MindSpeed, megatron-core distributed, Hugging Face and
  DeepSpeed checkpoints (``ckpt``).

Importing this package is cheap; ``ConfigChecker`` is loaded on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConfigChecker"]


def __getattr__(name: str) -> Any:
    if name == "ConfigChecker":
        from msprobe_core.config_check.checker import ConfigChecker

        return ConfigChecker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
