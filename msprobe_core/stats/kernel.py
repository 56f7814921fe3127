"""The optional one-pass statistics kernel behind a small interface, with its kill switch.

``KERNEL`` is the compiled ``_fast_stats`` module, or None when it was not built (no C compiler at
install) or ``MSPROBE_FAST_STATS=0`` turned it off; callers then use their framework's own reductions.
Its functions (see ``_fast_stats.c``):

- ``stats(address, numel, code, eps, threads)`` -> (max, min, sum, sum of squares, zeros, NaNs);
- ``copy_stats(dst, src, numel, code, eps, threads)`` -> the same, while copying the buffer to ``dst``;
- ``buffer(address, nbytes)`` -> a read-only memoryview of the bytes;
- ``Entry`` and ``RecordText``: the dump's per-version tensor entries and its forward records' JSON text in C
  (``pytorch/summarize.py``).

Dtype codes: float32 0, float64 1, bfloat16 2, int64 3, int32 4, int16 5, int8 6, uint8 7, bool 8.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

KILL_SWITCH_ENV = "MSPROBE_FAST_STATS"
"""``MSPROBE_FAST_STATS=0`` turns the kernel off (statistics then come from the framework's reductions)."""

try:
    from msprobe_core.stats import _fast_stats as _compiled
except ImportError:  # pragma: no cover - built without a C compiler
    _compiled = None

KERNEL: Optional[ModuleType] = None if os.environ.get(KILL_SWITCH_ENV, "1") == "0" else _compiled
