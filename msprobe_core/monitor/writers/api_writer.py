"""The ``api`` format: the latest step's metrics kept in memory and handed to the caller as a dict."""

from __future__ import annotations

from typing import Any, Sequence

from msprobe_core.monitor.records import MetricRow, display_name
from msprobe_core.monitor.step_rows import StepRows
from msprobe_core.monitor.writers.base import MetricWriter, WriterContext


class ApiWriter(MetricWriter):
    """``latest`` is ``{"step": s, "metrics": {kind: {name: {op: value}}}}`` for the last monitored step."""

    def __init__(self, context: WriterContext):
        self.context = context
        self.latest: dict[str, Any] = {}

    def write(self, step: int, rows: Sequence[MetricRow]) -> None:
        rows = StepRows.of(rows)
        ops, lay, with_micro = self.context.ops, rows.layout, self.context.with_micro
        metrics: dict[str, dict[str, dict[str, float]]] = {}
        for kind, name, micro, values in zip(lay.kinds, lay.names, lay.micros, rows.values.tolist()):
            metrics.setdefault(kind, {})[display_name(name, micro, with_micro)] = dict(zip(ops, values))
        self.latest = {"step": step, "metrics": metrics}
