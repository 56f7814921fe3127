"""Megatron-LM's own training loop (``megatron.training``) ships with megatron-core 0.17 and later only (Python
3.12+, ``make test-megatron-latest``): where it is not installed, its tests are not collected at all (rather than
shown as skips). Select them alone with ``-m megatron_training``."""

import importlib.util


def _has_megatron_training() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


collect_ignore = [] if _has_megatron_training() else ["test_megatron_training.py"]
