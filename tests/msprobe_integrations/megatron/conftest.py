"""Megatron-LM's own training loop (``megatron.training``) ships with megatron-core 0.17 and later only (Python
3.12+, ``make test-megatron-latest``): where it is not installed, its tests are not collected at all (rather than
shown as skips). Select them alone with ``-m megatron_training``."""

import importlib.util

import pytest


def _has_megatron_training() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


collect_ignore = [] if _has_megatron_training() else ["test_megatron_training.py"]


@pytest.fixture(scope="module")
def megatron_cpu():
    """megatron-core on CPU in this process: the CPU patches, a one-rank gloo group, model parallel state."""
    import megatron_support as ms

    with ms.megatron_on_cpu():
        yield
