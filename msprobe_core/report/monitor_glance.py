"""The monitor report's run at a glance: a heat map of modules (down) by steps (across), and for each alert
the few series that matter (its origin and the same metric of the modules beside it).

A cell is how far the module's norms are from their own median at that step: for each norm series of the
model's tensors (``{kind}_norm`` of activations, their gradients, weight gradients and weights; optimizer
moments are left out: they ramp up from zero) the distance |ln(value) - median| to the median ln(value)
of that series over the whole run (a lasting shift late in the run shows as a band from its step on; one
in the first half becomes the median, and the steps before it are coloured), and the cell the largest of
its module's series (NaN or Inf: ``BAD``). A module's inputs count only when it has no output (they are
the outputs of the module before it). Long runs are binned to at most ``MAX_COLUMNS`` columns (a bin shows its
largest distance). Rows are the modules in the order their series first appear in the monitor's files (the
CSV rows are in the order the data was produced: forward order); ties in natural order.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

MAX_COLUMNS = 400
HEAT_KINDS = ("actv", "actv_grad", "grad", "param")
BAD = -1.0
"""A cell holding NaN or Inf."""
PARAM_KINDS = ("grad", "param", "exp_avg", "exp_avg_sq")
"""Kinds named by a parameter (its module is the name less the last component); other kinds name a module's
input or output (``{module}.output``, ``{module}.input.1``)."""
_IO = re.compile(r"\.(input|output)(\..*)?$")
_INPUT = re.compile(r"\.input(\.|$)")
_DIGITS = re.compile(r"(\d+)")


def module_of(name: str, kind: str) -> str:
    """The module a series belongs to (``name`` as the monitor writes it, a micro-batch suffix ``:m`` dropped)."""
    base = name.rsplit(":", 1)[0] if re.search(r":\d+$", name) else name
    if kind in PARAM_KINDS:
        return base.rpartition(".")[0] or base
    return _IO.sub("", base) or base


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in _DIGITS.split(name)]


def _kind(metric: str) -> str:
    return metric.rpartition("_")[0]


def glance(charts: Sequence[dict], anomalies: Sequence[dict], seen: Sequence[int]) -> dict[str, Any]:
    """The heat map (``modules``, ``columns``: first step of each column, ``cells``: distance per module and
    column or None, ``worst``: chart index behind each cell) and, per anomaly, its ``row``, ``column`` and
    ``related`` charts (set on the anomaly dicts). ``seen[k]``: where chart k's series first appeared."""
    steps = sorted({p[0] for c in charts for pts in c["series"].values() for p in pts})
    module_of_chart = {k: module_of(charts[k]["name"], _kind(charts[k]["metric"])) for k in range(len(charts))}
    norms = [k for k, c in enumerate(charts) if c["metric"].endswith("_norm") and _kind(c["metric"]) in HEAT_KINDS]
    with_output = {module_of_chart[k] for k in norms if not _INPUT.search(charts[k]["name"])}
    norms = [k for k in norms if not _INPUT.search(charts[k]["name"]) or module_of_chart[k] not in with_output]
    first: dict[str, int] = {}
    for k in norms:
        first[module_of_chart[k]] = min(first.get(module_of_chart[k], seen[k]), seen[k])
    modules = sorted(first, key=lambda m: (first[m], _natural(m)))
    row_of = {m: i for i, m in enumerate(modules)}
    per = max(1, math.ceil(len(steps) / MAX_COLUMNS))
    columns = steps[::per]
    col_of = {s: i // per for i, s in enumerate(steps)}
    cells: list[list[float | None]] = [[None] * len(columns) for _ in modules]
    worst: list[list[int]] = [[-1] * len(columns) for _ in modules]
    for k in norms:
        row = row_of[module_of_chart[k]]
        rc, rw = cells[row], worst[row]
        for pts in charts[k]["series"].values():
            for s, d in _distances(pts):
                c = col_of[s]
                old = rc[c]
                if old is None or (old != BAD and (d == BAD or d > old)):
                    rc[c], rw[c] = d, k
    for a in anomalies:
        module = a.get("module") or ""
        a["row"] = row_of.get(module, row_of.get(module_of(a["name"], a["kind"]), -1))
        a["column"] = col_of.get(a["step"], -1)
        a["related"] = _related(charts, module_of_chart, seen, a["chart"])
    return {"modules": modules, "columns": columns, "per": per, "cells": cells, "worst": worst}


def _distances(points: Sequence[Sequence[Any]]) -> list[tuple[int, float]]:
    """(step, distance |ln|value| - median|) of one series, the median over the whole run's finite, non-zero
    values; a NaN or Inf value is ``BAD``; zeros are left out (no level)."""
    bad = [isinstance(v, str) or (isinstance(v, float) and not math.isfinite(v)) for _s, v in points]
    levels = {i: math.log(abs(v)) for i, (_s, v) in enumerate(points) if not bad[i] and v != 0}
    if levels:
        ordered = sorted(levels.values())
        n = len(ordered)
        med = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
    return [(s, BAD if bad[i] else round(abs(levels[i] - med), 3))
            for i, (s, _v) in enumerate(points) if bad[i] or i in levels]


def _related(charts: Sequence[dict], module_of_chart: dict[int, str], seen: Sequence[int], chart: int) -> list[int]:
    """The anomaly's chart, and the same metric of the module before it and of the two after it (in the order
    the data was produced; a module's inputs are left out: they are the outputs before them)."""
    if chart < 0:
        return []
    metric, module = charts[chart]["metric"], module_of_chart[chart]
    same = sorted((k for k, c in enumerate(charts) if c["metric"] == metric and
                   (k == chart or (module_of_chart[k] != module and not _INPUT.search(c["name"])))),
                  key=lambda k: seen[k])
    at = same.index(chart)
    return same[max(0, at - 1):at + 3]
