"""The router series in the monitor's formats.

* ``csv``: ``moe_router.csv`` in the rank's folder, one line per series and step:
  ``name,step,metric,value`` with ``name`` the router module and ``metric`` one of ``load.{expert}``,
  ``imbalance_max_mean``, ``imbalance_cv``, ``entropy``, ``dropped_tokens``, ``router_cos_max``,
  ``router_cos_mean`` (flushed every step).
* ``tensorboard``: tags ``{router}/router_{metric}`` (``tensorboard_tag(name, "router", metric)``), one
  event per step, in an event file of their own in the rank's folder.
* ``api``: ``get_metrics()["metrics"]["router"][router][metric]``.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import IO, Any, Sequence

from msprobe_core.monitor.moe.routers import RouterStep
from msprobe_core.monitor.writers.tensorboard_tags import tensorboard_tag

CSV_NAME = "moe_router.csv"
ROUTER_KIND = "router"
CSV_HEADER = ("name", "step", "metric", "value")


class RouterWriter:
    """Writes each monitored step's ``RouterStep``s in the configured formats."""

    def __init__(self, rank_dir: Path, formats: Sequence[str], ndigits: int):
        self.rank_dir = Path(rank_dir)
        self.formats = tuple(formats)
        self._fmt = f"{{:.{ndigits}g}}".format
        self._csv: tuple[IO[str], Any] | None = None
        self._tb: Any = None

    def write(self, step: int, routers: Sequence[RouterStep], latest: dict[str, Any] | None) -> None:
        series = [(r.layer, r.metrics()) for r in routers]
        if "csv" in self.formats:
            handle, writer = self._csv_file()
            for layer, metrics in series:
                writer.writerows([layer, step, m, self._fmt(v)] for m, v in metrics.items())
            handle.flush()
        if "tensorboard" in self.formats:
            self._tensorboard(step, series)
        if latest is not None and "metrics" in latest:
            latest["metrics"][ROUTER_KIND] = dict(series)

    def _csv_file(self) -> tuple[IO[str], Any]:
        if self._csv is None:
            self.rank_dir.mkdir(parents=True, exist_ok=True)
            handle = open(self.rank_dir / CSV_NAME, "w", newline="", encoding="utf-8")
            writer = csv.writer(handle)
            writer.writerow(CSV_HEADER)
            self._csv = (handle, writer)
        return self._csv

    def _tensorboard(self, step: int, series: Sequence[tuple[str, dict[str, float]]]) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        if self._tb is None:
            from tensorboardX import SummaryWriter

            self.rank_dir.mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(logdir=str(self.rank_dir), filename_suffix=".moe")
        values = [Summary.Value(tag=tensorboard_tag(layer, ROUTER_KIND, m), simple_value=v)
                  for layer, metrics in series for m, v in metrics.items()]
        if values:
            self._tb._get_file_writer().add_summary(Summary(value=values), step)
            self._tb.flush()

    def close(self) -> None:
        if self._csv is not None:
            self._csv[0].close()
            self._csv = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
