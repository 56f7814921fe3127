"""``MetricOutput``: the metric writers of one rank (csv, tensorboard, api), made on first use and closed
together; it hands each monitored step's rows to every writer once."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from msprobe_core.monitor.records import MetricRow
from msprobe_core.monitor.writers import ApiWriter, MetricWriter, WriterContext, make_writers

logger = logging.getLogger("msprobe_core.monitor")


class MetricOutput:
    """The writers of the formats ``formats``, for the run ``context()`` describes when they are made."""

    def __init__(self, formats: Sequence[str], context: Callable[[], WriterContext]):
        self.formats = tuple(formats)
        self._context = context
        self._writers: list[MetricWriter] | None = None

    def open(self) -> list[MetricWriter]:
        """The writers, made now if not yet (a missing tensorboardX fails here)."""
        if self._writers is None:
            self._writers = make_writers(self.formats, self._context())
        return self._writers

    def write(self, step: int, rows: Sequence[MetricRow]) -> dict[str, Any] | None:
        """Write one step's rows with every writer; returns the ``api`` writer's dict (None without one)."""
        result = None
        for w in self.open():
            w.write(step, rows)
            if isinstance(w, ApiWriter):
                result = w.latest
        return result

    def close(self) -> None:
        """Flush and close every writer (made again on the next write)."""
        if self._writers:
            for w in self._writers:
                try:
                    w.close()
                except Exception:  # pragma: no cover
                    logger.exception("monitor: closing a writer failed")
        self._writers = None
