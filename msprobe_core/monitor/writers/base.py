"""The writer interface and what every writer needs to know about the run."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from msprobe_core.monitor.records import MetricRow


@dataclass(frozen=True)
class WriterContext:
    """Where and how a rank's metrics are written."""

    rank_dir: Path
    ops: tuple[str, ...]
    ndigits: int = 6
    with_micro: bool = False
    """Per-micro-batch names carry ``:micro`` in TensorBoard tags and api keys (gradient accumulation > 1)."""
    step_count_per_record: int = 1
    step_interval: int = 1


class MetricWriter(ABC):
    """Receives each monitored step's rows once, in call order."""

    @abstractmethod
    def write(self, step: int, rows: Sequence[MetricRow]) -> None:
        """Write one optimizer step's rows."""

    def flush(self) -> None:
        """Make everything written so far durable."""

    def close(self) -> None:
        """Flush and release files; the writer is not used afterwards."""
        self.flush()
