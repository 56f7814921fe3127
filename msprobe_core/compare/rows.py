"""Rows of a comparison: one per tensor (or plain value) of every record pair, judged from dump.json.

``build_rows`` walks the aligned record pairs, matches their leaves by path (``input.0``,
``output.0``, ``parameters.weight``...) and judges each from the summaries alone (dtype, shape,
Max/Min/Mean/Norm, md5). In tensor mode, each pair of tensors with files becomes a ``TensorJob`` whose
metrics ``tensors.run_jobs`` computes later; its verdict is set then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from msprobe_core.compare.framework_map import cross_framework, same_dtype
from msprobe_core.compare.thresholds import (ERROR, PASS, STAT_KEYS, UNMATCHED, WARNING, Thresholds,
                                             worst)
from msprobe_core.dumpdir.rank_dump import RankDump
from msprobe_core.dumpdir.record_leaves import Leaf, flatten_record, is_tensor_summary, record_problem
from msprobe_core.errors import DumpInputError
from msprobe_core.files.safe_names import is_plain_file_name

TENSOR_METRICS = ("Cosine", "RMSE", "MaxAbsErr", "MaxRelativeErr",
                  "One Thousandth Err Ratio", "One Ten-Thousandth Err Ratio")
STAT_DIFFS = tuple(f"{k} diff" for k in STAT_KEYS) + tuple(f"{k} RelDiff" for k in STAT_KEYS)


@dataclass(frozen=True)
class TensorJob:
    """Two tensor files to compare."""

    target_file: str
    golden_file: str


@dataclass
class Row:
    """One compared leaf. ``order`` is the position of its record pair in execution order."""

    order: int
    target_record: Optional[str]
    golden_record: Optional[str]
    path: str
    target: Optional[dict]
    golden: Optional[dict]
    verdict: str = PASS
    messages: list[str] = field(default_factory=list)
    metrics: dict[str, Optional[float]] = field(default_factory=dict)
    job: Optional[TensorJob] = None
    unreadable: bool = False  # a record the comparison could not read (its warning row)

    def name(self, side: str) -> str:
        """Full leaf name on ``side`` ('target' or 'golden'), '' when that side lacks it."""
        record = self.target_record if side == "target" else self.golden_record
        summary = self.target if side == "target" else self.golden
        if record is None or (summary is None and self.path):
            return ""
        return f"{record}.{self.path}" if self.path else record

    def judge(self, verdict: str, messages: Sequence[str] = ()) -> None:
        """Raise the verdict to ``verdict`` (never lowers it) and add messages."""
        self.verdict = worst(self.verdict, verdict) if self.verdict != UNMATCHED else UNMATCHED
        self.messages.extend(messages)


def compare_mode(target: RankDump, golden: RankDump) -> tuple[str, list[str]]:
    """The mode two rank dumps can be compared in, plus notes for the user; errors when they cannot."""
    for dump in (target, golden):
        if dump.task in ("overflow_check", "nan_check"):  # nan_check: msprobe 26's name for it
            raise DumpInputError(f"{dump.json_path}: an overflow_check dump holds only overflowing calls and "
                                 "cannot be compared; dump both runs with task statistics or tensor")
    if target.framework != golden.framework and not cross_framework(target.framework, golden.framework):
        raise DumpInputError(f"mismatched dumps: {target.json_path} is framework '{target.framework}' but "
                             f"{golden.json_path} is '{golden.framework}'")
    if target.level != golden.level:
        raise DumpInputError(f"mismatched dumps: {target.json_path} is level '{target.level}' but "
                             f"{golden.json_path} is level '{golden.level}'; dump both runs at the same level")
    tasks = (target.task, golden.task)
    if tasks == ("tensor", "tensor"):
        return "tensor", []
    if "structure" in tasks:
        mode = "structure"
    else:
        mode = "statistics"
    notes = [] if tasks[0] == tasks[1] else [
        f"target task '{tasks[0]}' and golden task '{tasks[1]}' differ: compared as {mode} ({mode} "
        "information is what both dumps hold)"]
    return mode, notes


def build_rows(merged: Sequence[tuple[Optional[str], Optional[str]]], target: RankDump, golden: RankDump,
               mode: str, thresholds: Thresholds) -> list[Row]:
    """Rows for the aligned record pairs ``merged`` (from ``align.align_records``)."""
    rows: list[Row] = []
    t_dir = str(target.tensor_dir)
    g_dir = str(golden.tensor_dir)
    for order, (t_name, g_name) in enumerate(merged):
        problems = [f"{side} record cannot be read: {problem}" for side, dump, name in
                    (("target", target, t_name), ("golden", golden, g_name))
                    if name is not None and (problem := record_problem(dump.data[name])) is not None]
        if problems:  # never skipped silently: a warning row, counted in the summary
            rows.append(Row(order, t_name, g_name, "", None, None, verdict=UNMATCHED if None in (t_name, g_name)
                            else WARNING, messages=problems, unreadable=True))
            continue
        t_leaves = flatten_record(target.data[t_name]) if t_name is not None else []
        g_leaves = flatten_record(golden.data[g_name]) if g_name is not None else []
        if t_name is None or g_name is None:
            side = "target" if g_name is None else "golden"
            leaves = t_leaves or g_leaves
            for leaf in leaves or [Leaf("", {})]:
                row = Row(order, t_name, g_name, leaf.path, leaf.summary if t_name else None,
                          leaf.summary if g_name else None, verdict=UNMATCHED,
                          messages=[f"record only in the {side} run"])
                rows.append(row)
            continue
        g_by_path = {leaf.path: leaf for leaf in g_leaves}
        seen = set()
        for leaf in t_leaves:
            other = g_by_path.get(leaf.path)
            seen.add(leaf.path)
            rows.append(_compare_leaf(order, t_name, g_name, leaf.path, leaf.summary,
                                      other.summary if other else None, mode, thresholds, t_dir, g_dir))
        for leaf in g_leaves:
            if leaf.path not in seen:
                rows.append(_compare_leaf(order, t_name, g_name, leaf.path, None, leaf.summary, mode,
                                          thresholds, t_dir, g_dir))
    return rows


def record_distance(target_record: Any, golden_record: Any) -> float:
    """How unlike two records are from their summaries (0 = alike; about 1 per differing tensor).

    Used to decide which of several identical neighbouring calls is the extra one.
    """
    t_leaves = {leaf.path: leaf.summary for leaf in flatten_record(target_record)}
    g_leaves = {leaf.path: leaf.summary for leaf in flatten_record(golden_record)}
    cost = 0.0
    for path in t_leaves.keys() | g_leaves.keys():
        t, g = t_leaves.get(path), g_leaves.get(path)
        if t is None or g is None or t.get("shape") != g.get("shape") or t.get("type") != g.get("type"):
            cost += 1.0
        elif not is_tensor_summary(t):
            cost += 0.0 if t.get("value") == g.get("value") else 1.0
        elif t.get("md5") is not None and t.get("md5") == g.get("md5"):
            continue
        else:
            for key in STAT_KEYS:
                tv, gv = number(t.get(key)), number(g.get(key))
                if tv is None or gv is None or tv == gv:
                    continue
                if math.isfinite(tv) and math.isfinite(gv):
                    cost += abs(tv - gv) / (abs(tv) + abs(gv)) / len(STAT_KEYS)
                elif not (math.isnan(tv) and math.isnan(gv)):
                    cost += 1.0 / len(STAT_KEYS)
    return cost


def number(value: Any) -> Optional[float]:
    """A statistic from dump.json as a float (NaN/Infinity included); None when absent or not numeric."""
    if value is None or isinstance(value, (dict, list)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _data_file(directory: str, summary: dict) -> Optional[str]:
    name = summary.get("data_name")
    if is_plain_file_name(name) and name.endswith((".pt", ".npy")):  # never a path out of the tensor folder
        return f"{directory}/{name}"
    return None


def _compare_leaf(order: int, t_name: str, g_name: str, path: str, t: Optional[dict], g: Optional[dict],
                  mode: str, th: Thresholds, t_dir: str, g_dir: str) -> Row:
    row = Row(order, t_name, g_name, path, t, g)
    if t is None or g is None:
        row.judge(WARNING, [f"{path} only in the {'target' if g is None else 'golden'} run"])
        return row
    t_tensor, g_tensor = is_tensor_summary(t), is_tensor_summary(g)
    if not t_tensor and not g_tensor:
        if t.get("type") != g.get("type") or t.get("value") != g.get("value"):
            row.judge(WARNING, [f"value {t.get('value')!r} vs {g.get('value')!r}"])
        return row
    if t_tensor != g_tensor:
        row.judge(WARNING, [f"{t.get('type')} vs {g.get('type')}"])
        return row
    same_shape = t.get("shape") == g.get("shape")
    if not same_shape:
        row.judge(ERROR, [f"shape {t.get('shape')} vs {g.get('shape')}"])
    if not same_dtype(t.get("dtype"), g.get("dtype")):
        row.judge(WARNING, [f"dtype {t.get('dtype')} vs {g.get('dtype')}"])
    if mode == "tensor" and same_shape:
        t_file, g_file = _data_file(t_dir, t), _data_file(g_dir, g)
        if t_file and g_file:
            row.job = TensorJob(t_file, g_file)  # judged from the files, NaN/Inf included
            return row
        row.messages.append("no tensor file on " + ("either side" if not (t_file or g_file)
                                                    else "the " + ("golden" if t_file else "target") + " side")
                            + "; judged from statistics")
    if mode != "structure":
        row.judge(*th.stat_verdict(_stat_diffs(row, t, g)))
        t_md5, g_md5 = t.get("md5"), g.get("md5")
        if t_md5 is not None and g_md5 is not None and t_md5 != g_md5:
            row.judge(ERROR, [f"md5 {t_md5} vs {g_md5}"])
    return row


def _stat_diffs(row: Row, t: dict, g: dict) -> dict[str, tuple[float, float]]:
    """Fill the diff metrics; return ``{stat: (abs diff, rel diff)}`` of the finite statistics."""
    diffs: dict[str, tuple[float, float]] = {}
    for key in STAT_KEYS:
        tv, gv = number(t.get(key)), number(g.get(key))
        if tv is None or gv is None:
            continue
        if not (math.isfinite(tv) and math.isfinite(gv)):
            if not (tv == gv or (math.isnan(tv) and math.isnan(gv))):
                row.judge(ERROR, [f"{key} {tv} vs {gv} (NaN/Inf on one side)"])
            continue
        diff = tv - gv
        rel = abs(diff) / abs(gv) if gv else (0.0 if diff == 0 else math.inf)
        row.metrics[f"{key} diff"] = diff
        row.metrics[f"{key} RelDiff"] = rel
        diffs[key] = (abs(diff), rel)
    return diffs
