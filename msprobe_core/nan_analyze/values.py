"""Is a dumped tensor NaN/Inf? Decided from its statistics, or from its tensor file when they say nothing.

A statistics dump records ``Max``/``Min`` of every tensor; any NaN makes both NaN (torch's max and min
propagate NaN) and an Inf shows as ``Max = inf`` or ``Min = -inf``, so two numbers answer the question. A
summary without usable Max/Min (an md5-only summary, a dump written by another tool) is answered from its
``data_name`` file in ``dump_tensor_data`` when the dump has one.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from msprobe_core.dumpdir.rank_dump import data_file
from msprobe_core.dumpdir.record_info import tensor_file_summary
from msprobe_core.dumpdir.record_leaves import Leaf

STAT_KEYS = ("Max", "Min")


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # "NaN", "inf" written as text by some writers
        try:
            return float(value)
        except ValueError:
            return None
    return None


def stats_state(summary: dict) -> Optional[bool]:
    """True when Max or Min is NaN/Inf, False when both are finite, None when the summary has neither."""
    seen = False
    for key in STAT_KEYS:
        value = _number(summary.get(key))
        if value is None:
            continue
        if not math.isfinite(value):
            return True
        seen = True
    return False if seen else None


def leaf_is_bad(leaf: Leaf, tensor_dir: Optional[str]) -> bool:
    """Whether one leaf (a tensor of a record) holds NaN or Inf; plain values never do."""
    if not leaf.is_tensor:
        return False
    state = stats_state(leaf.summary)
    if state is not None:
        return state
    path = data_file(leaf.summary, tensor_dir)
    if path is None:
        return False
    counts = tensor_file_summary(path)
    return counts["nan"] + counts["inf"] > 0


def signature(summary: dict) -> Optional[tuple]:
    """What identifies a tensor's statistics: dtype, shape, Max, Min, Mean, Norm (None for plain values).

    Two summaries with the same signature are taken to be the same tensor version; used to recognise a
    tensor whose statistics were taken before an in-place collective changed it.
    """
    if "shape" not in summary:
        return None
    stats = tuple(repr(_number(summary.get(k))) for k in ("Max", "Min", "Mean", "Norm"))
    return (str(summary.get("dtype")), tuple(summary.get("shape") or ()), *stats)
