"""Shared test fixtures: a fresh PrecisionDebugger per test.

The test tree mirrors the code (``tests/msprobe_core/<feature>/``, ``tests/msprobe_integrations/<framework>/``);
shared helpers live in ``tests/support/`` and the stand-ins for what cannot run here (vLLM's engine,
Megatron-LM's ``megatron.training``) in ``tests/standins/``: both are importable by name from every test. Test
files are imported in pytest's importlib mode (pyproject.toml): no test folder goes on ``sys.path``, so a folder
named like a package (``tests/msprobe_core/mindspore``) never shadows it, and test files do not import each other
(what they share lives in ``tests/support/``)."""

from __future__ import annotations

import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
for p in (ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(TESTS, "support"), os.path.join(TESTS, "standins")):
    if p not in sys.path:
        sys.path.insert(0, p)

collect_ignore = ["msprobe_core/mindspore/test_msadapter_dump.py"]
"""Runs only inside .venv-msadapter, where mindtorch replaces torch: ``make test-msadapter`` runs it there,
without this conftest (which imports the real torch)."""


@pytest.fixture(autouse=True)
def _fresh_debugger():
    """Every test starts and ends without a process-wide debugger (and with torch restored)."""
    from msprobe_core.pytorch import PrecisionDebugger
    PrecisionDebugger.reset()
    yield
    PrecisionDebugger.reset()
