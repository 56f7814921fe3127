"""A rank folder as the report's tree: compact columns the page turns into nodes only when expanded.

``rank_tree(dump)`` returns::

    {"label": "step0/rank0", "path": "...", "names": [record, ...],     # execution order
     "parent": [index of the enclosing module or -1, ...],             # construct.json
     "leaves": [[[path, dtype, shape, Max, Min, Mean, Norm, extra], ...], ...],
     "stack": [index into "stacks" or -1, ...], "stacks": [[frame, ...], ...], "stack_from": {...},
     "nan": [indices of records holding NaN/Inf]}

A module that construct.json names as a parent but that has no record of its own gets a node without
tensors, so the hierarchy stays whole. NaN and Inf are written as strings (JSON has neither).
Identical stacks are stored once.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from msprobe_core.dumpdir.rank_dump import RankDump
from msprobe_core.dumpdir.record_info import record_stack
from msprobe_core.dumpdir.record_leaves import flatten_record

STAT_KEYS = ("Max", "Min", "Mean", "Norm")
_NOT_FINITE = ("NaN", "Inf", "-Inf")


def number(value: Any) -> Any:
    """A JSON-safe number: NaN/Inf as the strings ``NaN``, ``Inf``, ``-Inf`` (JSON has neither)."""
    if type(value) is float and not math.isfinite(value):
        return "NaN" if value != value else ("Inf" if value > 0 else "-Inf")
    return value


def _value_text(summary: dict) -> str:
    value = summary.get("value")
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def leaf_rows(record: Any) -> tuple[list[list], bool]:
    """The record's leaves as compact rows, and whether any tensor holds NaN/Inf."""
    rows: list[list] = []
    bad = False
    for leaf in flatten_record(record):
        s = leaf.summary
        if leaf.is_tensor:
            extra = s.get("md5") or s.get("data_name") or ""
            shape = s.get("shape")
            stats = [number(s.get(k)) for k in STAT_KEYS]
            rows.append([leaf.path, str(s.get("dtype", s.get("type", ""))).replace("torch.", ""),
                         "x".join(map(str, shape)) if isinstance(shape, (list, tuple)) else "", *stats, extra])
            bad = bad or stats[0] in _NOT_FINITE or stats[1] in _NOT_FINITE
        else:
            rows.append([leaf.path, str(s.get("type", "")), "", _value_text(s), None, None, None, ""])
    return rows, bad


def rank_tree(dump: RankDump, label: str) -> dict:
    """The tree data of one rank folder (see the module docstring)."""
    names = list(dump.data)
    index = {name: i for i, name in enumerate(names)}
    construct = dump.construct
    parents: list[Optional[str]] = [construct.get(n) for n in names]
    k = 0
    while k < len(parents):  # modules named only as parents become nodes too
        parent = parents[k]
        if parent is not None and parent not in index:
            index[parent] = len(names)
            names.append(parent)
            parents.append(construct.get(parent))
        k += 1
    leaves: list[list] = []
    nan: list[int] = []
    stack_ids: list[int] = []
    stacks: list[list[str]] = []
    stack_index: dict[tuple, int] = {}
    stack_from: dict[int, str] = {}
    for i, name in enumerate(names):
        record = dump.data.get(name)
        rows, bad = leaf_rows(record) if record is not None else ([], False)
        leaves.append(rows)
        if bad:
            nan.append(i)
        frames, note = record_stack(dump, name)
        key = tuple(frames)
        if not frames:
            stack_ids.append(-1)
            continue
        if key not in stack_index:
            stack_index[key] = len(stacks)
            stacks.append(frames)
        stack_ids.append(stack_index[key])
        if note:
            stack_from[i] = note
    return {"label": label, "path": str(dump.path), "task": dump.task, "level": dump.level,
            "names": names, "parent": [index[p] if p is not None else -1 for p in parents],
            "leaves": leaves, "stack": stack_ids, "stacks": stacks, "stack_from": stack_from, "nan": nan}
