"""A monitor output folder as the report's data: one series per (module or parameter, metric, rank).

Reads each rank folder's CSV files (``{kind}_{first}-{last}.csv``: ``name,step,[micro_step,]<ops>``)
or, for a rank written only in the ``tensorboard`` format, its event files with TensorBoard's own reader
(tags ``{name}/{kind}_{op}``), and every ``anomalies.json`` (ordered as ``python -m msprobe_core
anomalies`` orders them). Returns::

    {"charts": [{"name": "0.output", "metric": "actv_norm", "series": {"0": [[step, value], ...]}}],
     "anomalies": [{"rank", "step", "micro_step", "stage", "kind", "name", "metric", "value", "rule",
                    "chart": index of its chart or -1, "row", "column", "related": [chart, ...]}, ...],
     "glance": the heat map (``monitor_glance``)}

Later micro-batches are their own series (``name:1``), as in the monitor's TensorBoard tags.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Iterator, Optional

from msprobe_core.errors import DumpInputError
from msprobe_core.report.dump_data import number
from msprobe_core.report.monitor_glance import glance

CSV_NAME = re.compile(r"^(?P<kind>.+)_(?P<first>\d+)-(?P<last>\d+)\.csv$")
RANK_DIR = re.compile(r"^rank(\d+)$")
EVENTS_GLOB = "events.out.tfevents.*"
ANOMALY_FILE = "anomalies.json"

SeriesKey = tuple[str, str]  # (display name, "{kind}_{op}")


def _rank_dirs(root: Path) -> list[tuple[str, Path]]:
    ranks = sorted((d for d in root.iterdir() if d.is_dir() and RANK_DIR.match(d.name)),
                   key=lambda d: int(RANK_DIR.match(d.name).group(1)))
    if ranks:
        return [(RANK_DIR.match(d.name).group(1), d) for d in ranks]
    m = RANK_DIR.match(root.name)
    return [(m.group(1) if m else "0", root)]


def is_monitor_dir(root: Path) -> bool:
    """True when the folder (or its rank*/ folders) holds monitor CSVs, event files or anomalies.json."""
    if not root.is_dir():
        return False
    for _, d in _rank_dirs(root):
        if (d / ANOMALY_FILE).is_file() or any(d.glob(EVENTS_GLOB)) or any(CSV_NAME.match(p.name) for p in d.glob("*.csv")):
            return True
    return False


def display_name(name: str, micro: Optional[int]) -> str:
    """``name`` for the first micro-batch, ``name:m`` for later ones."""
    return f"{name}:{micro}" if micro else name


def _csv_points(rank_dir: Path) -> Iterator[tuple[SeriesKey, int, float]]:
    for path in sorted(rank_dir.glob("*.csv")):
        m = CSV_NAME.match(path.name)
        if not m:
            continue
        kind = m.group("kind")
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header or header[:2] != ["name", "step"]:
                continue
            micro = header[2] == "micro_step" if len(header) > 2 else False
            ops = header[3:] if micro else header[2:]
            first_value = 3 if micro else 2
            for row in reader:
                if len(row) < first_value + len(ops):
                    continue
                name = display_name(row[0], int(row[2]) if micro and row[2] not in ("", "-1") else None)
                step = int(row[1])
                for op, text in zip(ops, row[first_value:]):
                    try:
                        yield (name, f"{kind}_{op}"), step, float(text)
                    except ValueError:
                        continue


def _event_points(rank_dir: Path) -> Iterator[tuple[SeriesKey, int, float]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:  # pragma: no cover - tensorboard is a dependency of the monitor extra
        raise DumpInputError(f"{rank_dir}: reading TensorBoard event files needs the tensorboard package ({e}); "
                             "install it or write the monitor's CSV format") from None
    acc = EventAccumulator(str(rank_dir), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in acc.Tags().get("scalars", []):
        name, _, metric = tag.rpartition("/")
        if not name:
            continue
        if name.endswith(":0"):
            name = name[:-2]
        for event in acc.Scalars(tag):
            yield (name, metric), int(event.step), float(event.value)


def _anomalies(root: Path) -> list[dict]:
    from msprobe_core.monitor.anomaly_store import load_anomalies

    return [a.to_dict() for a in load_anomalies(root)]


def monitor_data(root: Path) -> dict:
    """Everything the monitor view shows, from a monitor output folder."""
    series: dict[SeriesKey, dict[str, dict[int, float]]] = {}
    for rank, rank_dir in _rank_dirs(root):
        points = _csv_points(rank_dir) if any(CSV_NAME.match(p.name) for p in rank_dir.glob("*.csv")) \
            else _event_points(rank_dir) if any(rank_dir.glob(EVENTS_GLOB)) else iter(())
        for key, step, value in points:
            series.setdefault(key, {}).setdefault(rank, {})[step] = value
    keys = sorted(series)
    chart_of = {key: i for i, key in enumerate(keys)}
    charts = [{"name": name, "metric": metric,
               "series": {rank: [[s, number(v)] for s, v in sorted(points.items())]
                          for rank, points in sorted(series[(name, metric)].items(), key=lambda kv: int(kv[0]))}}
              for name, metric in keys]
    anomalies = []
    for a in _anomalies(root):
        key = (display_name(a["name"], a.get("micro_step")), f"{a['kind']}_{a['metric']}")
        for field in ("value", "baseline"):
            v = a.get(field)
            a[field] = number(float(v) if isinstance(v, (int, str)) and not isinstance(v, bool) else v)
        a["chart"] = chart_of.get(key, -1)
        anomalies.append(a)
    seen = {key: i for i, key in enumerate(series)}  # first appearance: the CSV rows' order is the data's
    return {"charts": charts, "anomalies": anomalies, "glance": glance(charts, anomalies, [seen[k] for k in keys])}
