"""Metric writers of the monitor: ``csv``, ``tensorboard`` (needs tensorboardX) and ``api`` (an in-memory dict).

``make_writers(formats, context)`` builds one writer per format; only the TensorBoard writer imports
tensorboardX, and only when that format is asked for.
"""

from __future__ import annotations

from typing import Sequence

from msprobe_core.monitor.writers.api_writer import ApiWriter
from msprobe_core.monitor.writers.base import MetricWriter, WriterContext
from msprobe_core.monitor.writers.csv_writer import CsvWriter

__all__ = ["ApiWriter", "CsvWriter", "MetricWriter", "WriterContext", "make_writers"]


def make_writers(formats: Sequence[str], context: WriterContext) -> list[MetricWriter]:
    """One writer per format name (``csv``, ``tensorboard``, ``api``)."""
    writers: list[MetricWriter] = []
    for fmt in formats:
        if fmt == "csv":
            writers.append(CsvWriter(context))
        elif fmt == "tensorboard":
            from msprobe_core.monitor.writers.tensorboard_writer import TensorBoardWriter

            writers.append(TensorBoardWriter(context))
        elif fmt == "api":
            writers.append(ApiWriter(context))
        else:  # validated by the config; kept for integrations that build writers themselves
            raise ValueError(f"unknown monitor format '{fmt}'; allowed: csv, tensorboard, api")
    return writers
