"""Shared test fixtures: a fresh PrecisionDebugger per test, small torch models."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)


@pytest.fixture(autouse=True)
def _fresh_debugger():
    """Every test starts and ends without a process-wide debugger (and with torch restored)."""
    from msprobe_core.pytorch import PrecisionDebugger
    PrecisionDebugger.reset()
    yield
    PrecisionDebugger.reset()
