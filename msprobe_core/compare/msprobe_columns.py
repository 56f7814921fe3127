"""msprobe's compare result columns (``compare --msprobe-columns``), for scripts that read msprobe's result
files by column name.

The same rows and verdicts as the default layout, under msprobe's headers (its ``CompareConst`` result
headers; the seeds name only some of them):

* tensor dumps: NPU Name, Bench Name, NPU Dtype, Bench Dtype, NPU Tensor Shape, Bench Tensor Shape,
  Requires_grad Consistent, Cosine, EucDist, MaxAbsErr, MaxRelativeErr, One Thousandth Err Ratio,
  Five Thousandths Err Ratio, NPU max, NPU min, NPU mean, NPU l2norm, Bench max, Bench min, Bench mean,
  Bench l2norm, Accuracy Reached or Not, Err_message, [NPU_Stack_Info], Data_name
* statistics dumps: ... Requires_grad Consistent, Max diff, Min diff, Mean diff, L2norm diff,
  MaxRelativeErr, MinRelativeErr, MeanRelativeErr, NormRelativeErr (percentages, "12.5%", as msprobe
  writes them), NPU max ... Bench l2norm, Result, Err_message, [NPU_Stack_Info]
* md5 dumps: ... Requires_grad Consistent, NPU MD5, BENCH MD5, Result, Err_message, [NPU_Stack_Info]
* structure dumps: names, dtypes, shapes, Requires_grad Consistent, Result, Err_message, [NPU_Stack_Info]

NPU is the target run, Bench the golden one. ``Accuracy Reached or Not`` is Yes (pass), No (error) or
Warning; ``Result`` is pass, Warning or error; an unmatched record and any value that does not apply are
``N/A`` (what msprobe writes there).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from msprobe_core.compare.columns import has_md5, side_value
from msprobe_core.compare.engine import PairResult
from msprobe_core.compare.rows import Row
from msprobe_core.compare.thresholds import ERROR, PASS, STAT_KEYS, UNMATCHED, WARNING

N_A = "N/A"
HEAD = ["NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape", "Bench Tensor Shape",
        "Requires_grad Consistent"]
SIDE_STATS = ["NPU max", "NPU min", "NPU mean", "NPU l2norm", "Bench max", "Bench min", "Bench mean", "Bench l2norm"]
TENSOR_METRICS = ["Cosine", "EucDist", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio",
                  "Five Thousandths Err Ratio"]
STAT_DIFFS = ["Max diff", "Min diff", "Mean diff", "L2norm diff", "MaxRelativeErr", "MinRelativeErr",
              "MeanRelativeErr", "NormRelativeErr"]
ACCURACY = {PASS: "Yes", WARNING: "Warning", ERROR: "No", UNMATCHED: N_A}
RESULT = {PASS: "pass", WARNING: "Warning", ERROR: "error", UNMATCHED: N_A}

_STAT_OF = dict(zip(("max", "min", "mean", "l2norm"), STAT_KEYS))  # "l2norm" -> "Norm"
_DIFF_OF = {"Max diff": "Max diff", "Min diff": "Min diff", "Mean diff": "Mean diff", "L2norm diff": "Norm diff",
            "MinRelativeErr": "Min RelDiff", "MeanRelativeErr": "Mean RelDiff", "NormRelativeErr": "Norm RelDiff"}


def columns(pair: PairResult, with_stack: bool = False) -> list[str]:
    """msprobe's header for ``pair``'s mode."""
    if pair.mode == "tensor":
        cols = HEAD + TENSOR_METRICS + SIDE_STATS + ["Accuracy Reached or Not", "Err_message"]
    elif pair.mode == "statistics" and has_md5(pair):
        cols = HEAD + ["NPU MD5", "BENCH MD5", "Result", "Err_message"]
    elif pair.mode == "statistics":
        cols = HEAD + STAT_DIFFS + SIDE_STATS + ["Result", "Err_message"]
    else:
        cols = HEAD + ["Result", "Err_message"]
    if with_stack:
        cols.append("NPU_Stack_Info")
    if pair.mode == "tensor":
        cols.append("Data_name")
    return cols


def _or_na(value: Any) -> Any:
    return N_A if value is None else value


def _percent(value: Optional[float]) -> Any:
    return N_A if value is None else f"{value * 100}%"


def _euclidean(row: Row) -> Optional[float]:
    rmse = row.metrics.get("RMSE")
    shape = (row.target or {}).get("shape")
    if rmse is None or not isinstance(shape, list):
        return None
    return rmse * math.sqrt(math.prod(shape))


def _requires_grad(row: Row) -> Any:
    t, g = (row.target or {}).get("requires_grad"), (row.golden or {}).get("requires_grad")
    return N_A if t is None or g is None else t == g


def _value(pair: PairResult, row: Row, col: str) -> Any:
    if col in ("NPU Name", "Bench Name"):
        return row.name("target" if col == "NPU Name" else "golden") or N_A
    side, _, what = col.partition(" ")
    summary = row.target if side == "NPU" else row.golden if side in ("Bench", "BENCH") else None
    if what in ("Dtype", "MD5"):
        return _or_na(side_value(summary, what))
    if what == "Tensor Shape":
        return _or_na(side_value(summary, "Shape"))
    if what in _STAT_OF:
        return _or_na(side_value(summary, _STAT_OF[what]))
    if col == "Requires_grad Consistent":
        return _requires_grad(row)
    if col == "EucDist":
        return _or_na(_euclidean(row))
    if col == "MaxRelativeErr" and pair.mode != "tensor":
        return _percent(row.metrics.get("Max RelDiff"))
    if col in _DIFF_OF:
        value = row.metrics.get(_DIFF_OF[col])
        return _percent(value) if col.endswith("RelativeErr") else _or_na(value)
    if col == "Accuracy Reached or Not":
        return ACCURACY.get(row.verdict, row.verdict)
    if col == "Result":
        return RESULT.get(row.verdict, row.verdict)
    if col == "Err_message":
        return "; ".join(row.messages)
    if col == "NPU_Stack_Info":
        return "\n".join(pair.target.stack.get(row.target_record or "", [])) or N_A
    if col == "Data_name":
        return str([side_value(row.target, "Data Name") or N_A, side_value(row.golden, "Data Name") or N_A])
    return _or_na(row.metrics.get(col))


def row_values(pair: PairResult, row: Row, cols: list[str]) -> list[Any]:
    """The cells of ``row`` under msprobe's header ``cols``."""
    return [_value(pair, row, col) for col in cols]
