"""Anomaly files: ``<rank dir>/anomalies.json`` and ``anomalies.csv`` written per rank, read back (the JSON
file) and ordered across ranks (no torch).

The JSON file is an array of anomaly objects, one per event (see ``Anomaly.to_dict``: the origin of a fault,
``reached`` and ``last_step`` say how far it spread, ``capture`` the folder of the evidence captured after
it); the CSV file holds the same records, one row per event under a header of the same field names (an
empty cell for None), for a spreadsheet or ``pandas.read_csv``. Both are rewritten atomically (write a
temporary file, then rename) at each step that found or grew something, so a reader never sees half a file.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Iterable, Sequence

from msprobe_core.errors import MonitorInputError
from msprobe_core.files.atomic_write import write_text_atomic
from msprobe_core.monitor.alert_db import read_anomalies
from msprobe_core.monitor.anomaly import Anomaly, order_key

ANOMALY_FILE = "anomalies.json"
ANOMALY_CSV = "anomalies.csv"
CSV_FIELDS = tuple(f.name for f in fields(Anomaly))
"""The header of ``anomalies.csv``: the fields of ``Anomaly``, in order."""


class AnomalyFileWriter:
    """Keeps one rank's anomalies and rewrites its ``anomalies.json`` and ``anomalies.csv`` when new ones arrive."""

    def __init__(self, rank_dir: str | os.PathLike):
        self.path = Path(rank_dir) / ANOMALY_FILE
        self.csv_path = Path(rank_dir) / ANOMALY_CSV
        self._items: list[dict] = []

    def add(self, anomalies: Iterable[Anomaly]) -> None:
        """Append anomalies and rewrite the file."""
        new = [a.to_dict() for a in anomalies]
        if new:
            self._items.extend(new)
            self._flush()

    def write(self, anomalies: Sequence[Anomaly]) -> None:
        """Rewrite the file with exactly ``anomalies`` (events whose reach grew are updated in place)."""
        self._items = [a.to_dict() for a in anomalies]
        self._flush()

    def _flush(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path, json.dumps(self._items, indent=1))
        text = io.StringIO()
        table = csv.DictWriter(text, CSV_FIELDS, lineterminator="\n")
        table.writeheader()
        table.writerows({k: "" if v is None else v for k, v in item.items()} for item in self._items)
        write_text_atomic(self.csv_path, text.getvalue())


def find_anomaly_files(monitor_dir: str | os.PathLike) -> list[Path]:
    """Every ``anomalies.json`` under a monitor output folder (one per rank), or the file itself."""
    root = Path(monitor_dir)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise MonitorInputError(f"'{monitor_dir}' is not a monitor output folder (it does not exist)")
    return sorted(root.rglob(ANOMALY_FILE))


def load_anomalies(monitor_dir: str | os.PathLike) -> list[Anomaly]:
    """All anomalies under ``monitor_dir`` (or in one ``anomalies.json``, or in an ``alert.inform`` SQLite
    database), every rank, in the order the data was produced."""
    found: list[Anomaly] = []
    for path in find_anomaly_files(monitor_dir):
        if is_sqlite(path):
            found.extend(read_anomalies(path))
            continue
        try:
            with open(path, encoding="utf-8") as f:
                items = json.load(f)
            if not isinstance(items, list):
                raise ValueError("the top level is not a list")
            found.extend(_checked(Anomaly.from_dict(d)) for d in items)
        except (OSError, ValueError, TypeError) as e:
            raise MonitorInputError(f"anomaly file '{path}' is not readable: {e}") from None
    found.sort(key=order_key)
    return found


_INT_FIELDS = ("rank", "step", "call_id", "pp_stage", "event", "reached")
_OPTIONAL_INT_FIELDS = ("micro_step", "last_step")
_STR_FIELDS = ("stage", "kind", "name", "module", "metric", "rule")


def _checked(anomaly: Anomaly) -> Anomaly:
    """``anomaly`` if its fields have their types (a damaged or hand-edited file can hold anything); else
    ``TypeError`` naming the field."""
    for key in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        value = getattr(anomaly, key)
        if not (isinstance(value, int) and not isinstance(value, bool)) and not (value is None and key in _OPTIONAL_INT_FIELDS):
            raise TypeError(f"field '{key}' = {value!r} is not an integer")
    for key in _STR_FIELDS:
        if not isinstance(getattr(anomaly, key), str):
            raise TypeError(f"field '{key}' = {getattr(anomaly, key)!r} is not a string")
    if anomaly.capture is not None and not isinstance(anomaly.capture, str):
        raise TypeError(f"field 'capture' = {anomaly.capture!r} is not a string")
    return anomaly


def is_sqlite(path: Path) -> bool:
    """Whether ``path`` is an SQLite database file (``alert.inform``'s)."""
    try:
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False
