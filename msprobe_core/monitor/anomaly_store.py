"""Anomaly files: ``<rank dir>/anomalies.json`` written per rank, read back and ordered across ranks (no torch).

The file is a JSON array of anomaly objects (see ``Anomaly.to_dict``), rewritten atomically (write a
temporary file, then rename) at each step that found something, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from msprobe_core.dump.step_recorder import write_text_atomic
from msprobe_core.errors import MsprobeError
from msprobe_core.monitor.anomaly import Anomaly, order_key

ANOMALY_FILE = "anomalies.json"


class MonitorInputError(MsprobeError, ValueError):
    """A path given to a monitor command is not a monitor output (or holds an unreadable file)."""


class AnomalyFileWriter:
    """Keeps one rank's anomalies and rewrites its ``anomalies.json`` when new ones arrive."""

    def __init__(self, rank_dir: str | os.PathLike):
        self.path = Path(rank_dir) / ANOMALY_FILE
        self._items: list[dict] = []

    def add(self, anomalies: Iterable[Anomaly]) -> None:
        new = [a.to_dict() for a in anomalies]
        if not new:
            return
        self._items.extend(new)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path, json.dumps(self._items, indent=1))


def find_anomaly_files(monitor_dir: str | os.PathLike) -> list[Path]:
    """Every ``anomalies.json`` under a monitor output folder (one per rank), or the file itself."""
    root = Path(monitor_dir)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise MonitorInputError(f"'{monitor_dir}' is not a monitor output folder (it does not exist)")
    return sorted(root.rglob(ANOMALY_FILE))


def load_anomalies(monitor_dir: str | os.PathLike) -> list[Anomaly]:
    """All anomalies under ``monitor_dir``, every rank, in the order the data was produced."""
    found: list[Anomaly] = []
    for path in find_anomaly_files(monitor_dir):
        try:
            with open(path, encoding="utf-8") as f:
                items = json.load(f)
            if not isinstance(items, list):
                raise ValueError("the top level is not a list")
            found.extend(Anomaly.from_dict(d) for d in items)
        except (OSError, ValueError, TypeError) as e:
            raise MonitorInputError(f"anomaly file '{path}' is not readable: {e}") from None
    found.sort(key=order_key)
    return found
