"""A compare output folder as the report's data: both runs' trees, each record's verdict, the divergence.

Reads ``compare_summary.json`` and each pair's ``compare_result*.csv`` (written by ``compare``), and the
two rank folders the summary names when they are still there (their construct.json gives the trees and
their stack.json the stacks; without them the trees are flat lists of the compared records). Per pair::

    {"label", "mode", "rows_count", "target": tree, "golden": tree,   # trees as in dump_data.rank_tree
     "t_verdict"/"g_verdict": [code per node], "t_match"/"g_match": [other side's node or -1],
     "columns": [metric names], "rows": {"t12": [[path, result, message, *metrics], ...]},
     "divergence": {"t", "g", "verdict", "parent", "stack", "rows", "inputs_differ"} | None, "first_warning"}

Codes: 0 pass, 1 warning, 2 error, 3 unmatched, -1 not compared.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any, Optional

from msprobe_core.dumpdir.layout import discover
from msprobe_core.dumpdir.rank_dump import load_rank_dump
from msprobe_core.errors import DumpInputError, MsprobeError
from msprobe_core.report.dump_data import number, rank_tree

SUMMARY_NAME = "compare_summary.json"
CODES = {"pass": 0, "warning": 1, "error": 2, "unmatched": 3}
FIXED_COLUMNS = {"Index", "Target Name", "Golden Name", "Target Dtype", "Golden Dtype", "Target Shape",
                 "Golden Shape", "Result", "Message", "Target Data Name", "Golden Data Name", "Target Stack",
                 "Target MD5", "Golden MD5"}
_SIDE_STAT = re.compile(r"^(Target|Golden) (Max|Min|Mean|Norm)$")
_LEAF_START = re.compile(r"\.(input|output|parameters)(\.|$)")


def is_compare_dir(path: Path) -> bool:
    """True for a compare output folder (or its compare_summary.json)."""
    return (path.is_file() and path.name == SUMMARY_NAME) or (path / SUMMARY_NAME).is_file()


def _flat_tree(names: list[str], label: str) -> dict:
    n = len(names)
    return {"label": label, "path": "", "task": "", "level": "", "names": names, "parent": [-1] * n,
            "leaves": [[] for _ in range(n)], "stack": [-1] * n, "stacks": [], "stack_from": {}, "nan": []}


def _load_tree(path: str, label: str) -> Optional[dict]:
    try:
        level, units = discover(Path(path))
        if len(units) != 1:
            return None
        return rank_tree(load_rank_dump(units[0].path), label)
    except MsprobeError:
        return None


def _record_of(leaf_name: str, known: dict[str, int]) -> str:
    """The record a CSV leaf name (``record.input.0``) belongs to."""
    if leaf_name in known:
        return leaf_name
    cut = len(leaf_name)
    while True:
        cut = leaf_name.rfind(".", 0, cut)
        if cut <= 0:
            break
        if leaf_name[:cut] in known:
            return leaf_name[:cut]
    m = _LEAF_START.search(leaf_name)
    if m:
        return leaf_name[:m.start()]
    if ".parameters_grad." in leaf_name:  # Module.x.Cls.parameters_grad.0.weight
        head, _, tail = leaf_name.partition(".parameters_grad.")
        return f"{head}.parameters_grad.{tail.split('.', 1)[0]}"
    return leaf_name


def _csv_path(pair: dict, compare_dir: Path) -> Optional[Path]:
    for out in pair.get("outputs") or []:
        if str(out).endswith(".csv"):
            for candidate in (Path(out), compare_dir / Path(out).name):
                if candidate.is_file():
                    return candidate
    return None


def _read_rows(csv_path: Path) -> tuple[list[str], list[dict]]:
    try:
        with open(csv_path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            header = list(reader.fieldnames or [])
    except OSError as e:
        raise DumpInputError(f"{csv_path}: cannot read the compare result ({e.strerror})") from None
    metrics = [c for c in header if c not in FIXED_COLUMNS and not _SIDE_STAT.match(c)]
    return metrics, rows


def _cell(text: str) -> Any:
    if text == "":
        return None
    try:
        return number(float(text))
    except ValueError:
        return text


def _side(tree: dict, names_in_order: list[str]) -> tuple[dict, dict[str, int]]:
    index = {n: i for i, n in enumerate(tree["names"])}
    missing = [n for n in names_in_order if n not in index]
    if missing:  # a record the tree lacks (a dump rewritten since): list it at the top level
        for n in missing:
            index[n] = len(tree["names"])
            tree["names"].append(n)
            tree["parent"].append(-1)
            tree["leaves"].append([])
            tree["stack"].append(-1)
    return tree, index


def pair_data(pair: dict, compare_dir: Path) -> dict:
    """The report data of one compared rank pair (see the module docstring)."""
    label = pair.get("label") or "pair"
    csv_path = _csv_path(pair, compare_dir)
    metrics, raw_rows = _read_rows(csv_path) if csv_path else ([], [])
    t_tree = _load_tree(pair.get("target", ""), "target " + label)
    g_tree = _load_tree(pair.get("golden", ""), "golden " + label)
    t_known = {n: 0 for n in (t_tree["names"] if t_tree else [])}
    g_known = {n: 0 for n in (g_tree["names"] if g_tree else [])}
    groups: dict[str, dict] = {}
    for row in raw_rows:
        g = groups.setdefault(row.get("Index", ""), {"t": None, "g": None, "rows": [], "verdict": 0})
        if row.get("Target Name") and g["t"] is None:
            g["t"] = _record_of(row["Target Name"], t_known)
        if row.get("Golden Name") and g["g"] is None:
            g["g"] = _record_of(row["Golden Name"], g_known)
        code = CODES.get(row.get("Result", ""), 0)
        g["verdict"] = code if code == 3 or g["verdict"] == 3 else max(g["verdict"], code)
        name = row.get("Target Name") or row.get("Golden Name") or ""
        record = g["t"] or g["g"] or ""
        path = name[len(record) + 1:] if name.startswith(record + ".") else ""
        g["rows"].append([path, row.get("Result", ""), row.get("Message", ""), *(_cell(row.get(c, "")) for c in metrics)])
    ordered = list(groups.values())
    t_tree, t_index = _side(t_tree or _flat_tree([], "target " + label), [g["t"] for g in ordered if g["t"]])
    g_tree, g_index = _side(g_tree or _flat_tree([], "golden " + label), [g["g"] for g in ordered if g["g"]])
    t_verdict, g_verdict = [-1] * len(t_tree["names"]), [-1] * len(g_tree["names"])
    t_match, g_match = [-1] * len(t_tree["names"]), [-1] * len(g_tree["names"])
    rows: dict[str, list] = {}
    for g in ordered:
        ti = t_index[g["t"]] if g["t"] else -1
        gi = g_index[g["g"]] if g["g"] else -1
        if ti >= 0:
            t_verdict[ti], t_match[ti] = g["verdict"], gi
            rows[f"t{ti}"] = g["rows"]
        if gi >= 0:
            g_verdict[gi], g_match[gi] = g["verdict"], ti
            if ti < 0:
                rows[f"g{gi}"] = g["rows"]

    def divergence(div: Optional[dict]) -> Optional[dict]:
        if not div:
            return None
        return {"t": t_index.get(div.get("target_record") or "", -1), "g": g_index.get(div.get("golden_record") or "", -1),
                "record": div.get("target_record"), "verdict": div.get("verdict"), "parent": div.get("parent"),
                "stack": div.get("stack") or [], "inputs_differ": bool(div.get("inputs_differ")),
                "rows": [[r.get("path", ""), "; ".join(r.get("messages") or []),
                          {k: number(v) for k, v in (r.get("metrics") or {}).items()}] for r in div.get("rows") or []]}

    return {"label": label, "mode": pair.get("mode", ""), "counts": pair.get("rows", {}), "notes": pair.get("notes", []),
            "target": t_tree, "golden": g_tree, "t_verdict": t_verdict, "g_verdict": g_verdict,
            "t_match": t_match, "g_match": g_match, "columns": metrics, "rows": rows,
            "divergence": divergence(pair.get("first_divergence")),
            "first_warning": divergence(pair.get("first_warning")),
            "csv": str(csv_path) if csv_path else None}


def compare_data(path: Path) -> dict:
    """Everything the compare view shows, from a compare output folder."""
    summary_path = path if path.is_file() else path / SUMMARY_NAME
    try:
        with open(summary_path, encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DumpInputError(f"{summary_path}: not a readable compare summary ({e})") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("pairs"), list):
        raise DumpInputError(f"{summary_path}: not a compare summary (expected an object with 'pairs')")
    compare_dir = summary_path.parent
    pairs = [pair_data(p, compare_dir) for p in summary["pairs"]]
    first = next((i for i, p in enumerate(pairs) if p["divergence"]), None)
    return {"target": summary.get("target"), "golden": summary.get("golden"),
            "thresholds": summary.get("thresholds", {}), "pairs": pairs, "first_pair": first}
