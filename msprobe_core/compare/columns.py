"""The default columns of a comparison's result table, and the cells of a row under them.

``Index`` (position in execution order), target/golden name, dtype and shape, then the metrics of the mode
(tensor: Cosine, RMSE, MaxAbsErr, MaxRelativeErr, One Thousandth Err Ratio, One Ten-Thousandth Err Ratio;
statistics: Max/Min/Mean/Norm diff and RelDiff; md5 dumps add both digests), both sides' Max/Min/Mean/Norm,
``Result`` (pass/warning/error/unmatched), ``Message``, and for tensor dumps the data file names. These
follow msprobe's compare columns with NPU/Bench renamed Target/Golden (``msprobe_columns`` has msprobe's
own names).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from msprobe_core.compare.engine import PairResult
from msprobe_core.compare.rows import STAT_DIFFS, TENSOR_METRICS, Row
from msprobe_core.compare.thresholds import STAT_KEYS


def columns(pair: PairResult, with_stack: bool = False) -> list[str]:
    """The header of a pair's result table."""
    cols = ["Index", "Target Name", "Golden Name", "Target Dtype", "Golden Dtype", "Target Shape", "Golden Shape"]
    if pair.mode == "tensor":
        cols += list(TENSOR_METRICS)
    elif pair.mode == "statistics":
        cols += list(STAT_DIFFS)
    if has_md5(pair):
        cols += ["Target MD5", "Golden MD5"]
    if pair.mode != "structure":
        cols += [f"Target {k}" for k in STAT_KEYS] + [f"Golden {k}" for k in STAT_KEYS]
    cols += ["Result", "Message"]
    if pair.mode == "tensor":
        cols += ["Target Data Name", "Golden Data Name"]
    if with_stack:
        cols += ["Target Stack"]
    return cols


def has_md5(pair: PairResult) -> bool:
    """True when the dumps hold md5 digests (msprobe's summary_mode md5), read from the first rows."""
    return any((r.target or {}).get("md5") is not None or (r.golden or {}).get("md5") is not None
               for r in pair.rows[:200])


def side_value(summary: Optional[dict], key: str) -> Any:
    """One side's cell ``key`` (``Dtype``, ``Shape``, ``Max``..., ``MD5``, ``Data Name``) from its summary."""
    if not summary:
        return None
    if key == "Dtype":
        return summary.get("dtype", summary.get("type"))
    if key == "Shape":
        shape = summary.get("shape")
        return str(list(shape)) if isinstance(shape, (list, tuple)) else None
    if key == "Max" and "value" in summary and "dtype" not in summary:
        value = summary.get("value")
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else json.dumps(value)
    if key in ("MD5", "Data Name"):
        return summary.get("md5" if key == "MD5" else "data_name")
    return summary.get(key)


def row_values(pair: PairResult, row: Row, cols: list[str]) -> list[Any]:
    """The cells of ``row`` under the header ``cols``."""
    out: list[Any] = []
    for col in cols:
        if col == "Index":
            out.append(row.order)
        elif col == "Target Name":
            out.append(row.name("target"))
        elif col == "Golden Name":
            out.append(row.name("golden"))
        elif col == "Result":
            out.append(row.verdict)
        elif col == "Message":
            out.append("; ".join(row.messages))
        elif col == "Target Stack":
            stack = pair.target.stack.get(row.target_record or "", [])
            out.append("\n".join(stack))
        elif col.startswith("Target "):
            out.append(side_value(row.target, col[len("Target "):]))
        elif col.startswith("Golden "):
            out.append(side_value(row.golden, col[len("Golden "):]))
        else:
            out.append(row.metrics.get(col))
    return out
