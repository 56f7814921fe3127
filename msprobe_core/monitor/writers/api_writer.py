"""The ``api`` format: the latest step's metrics kept in memory and handed to the caller as a dict."""

from __future__ import annotations

from typing import Any, Sequence

from msprobe_core.monitor.records import MetricRow, display_name
from msprobe_core.monitor.writers.base import MetricWriter, WriterContext


class ApiWriter(MetricWriter):
    """``latest`` is ``{"step": s, "metrics": {kind: {name: {op: value}}}}`` for the last monitored step."""

    def __init__(self, context: WriterContext):
        self.context = context
        self.latest: dict[str, Any] = {}

    def write(self, step: int, rows: Sequence[MetricRow]) -> None:
        ops = self.context.ops
        metrics: dict[str, dict[str, dict[str, float]]] = {}
        for row in rows:
            name = display_name(row.name, row.micro_step, self.context.with_micro)
            metrics.setdefault(row.kind, {})[name] = dict(zip(ops, row.values))
        self.latest = {"step": step, "metrics": metrics}
