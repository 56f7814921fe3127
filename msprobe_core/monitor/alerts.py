"""Where one rank's alerts go: the log, ``anomalies.json`` (``alert.dump``), the database (``alert.inform``)
and the registered callbacks. No torch.

``AlertCenter.publish(verdict)`` takes what ``AnomalyDetector.judge`` found at a step: each event opened
is logged once (a warning naming its origin), appended to the file and the database and passed to the
callbacks; events that reached more tensors are updated in the file and the database (and logged at
debug level); a step the loss scaler skipped is logged (info), counted in ``skipped_steps`` and recorded
in the database's ``skipped_steps`` table. A failing callback is logged, never raised into training.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Callable

from msprobe_core.monitor.alert_db import AnomalyDatabase, run_label
from msprobe_core.monitor.anomaly import Anomaly
from msprobe_core.monitor.anomaly_store import AnomalyFileWriter
from msprobe_core.monitor.config import AlertConfig
from msprobe_core.monitor.detector import SkippedStep, StepVerdict
from msprobe_core.monitor.events import EventTracker

logger = logging.getLogger("msprobe_core.monitor")

AnomalyCallback = Callable[[Anomaly], None]


class AlertCenter:
    """One rank's events and the places they are reported to."""

    def __init__(self, rank: int, rank_dir: str | os.PathLike, output_dir: str | os.PathLike):
        self.rank = rank
        self.rank_dir = Path(rank_dir)
        self.output_dir = Path(output_dir)
        self.events = EventTracker()
        """Shared by every detector of this rank (a configuration change does not split a spreading fault)."""
        self.callbacks: list[AnomalyCallback] = []
        self.evidence: Callable[[Anomaly], str | None] | None = None
        """Asked once per new event: the folder its evidence will be captured in (``on_anomaly.dump``), or None."""
        self.skipped_steps: list[SkippedStep] = []
        self._anomalies: list[Anomaly] = []
        self._file: AnomalyFileWriter | None = None
        self._db: AnomalyDatabase | None = None

    def configure(self, alert: AlertConfig) -> None:
        """Open or close the anomaly file and the database as ``alert`` asks (at start and on a config change)."""
        if alert.dump and self._file is None:
            self._file = AnomalyFileWriter(self.rank_dir)
            if self._anomalies:
                self._file.write(self._anomalies)
        elif not alert.dump:
            self._file = None
        want = alert.inform.path if alert.inform is not None else None
        if self._db is not None and (want is None or Path(want) != self._db.path):
            self._db.close()
            self._db = None
        if want is not None and self._db is None:
            self._db = AnomalyDatabase(want, run_label(self.output_dir), self.rank, alert.inform.connection_str)

    @property
    def anomalies(self) -> list[Anomaly]:
        """Every event of this rank so far (its origin, with how far it reached), in order."""
        return list(self._anomalies)

    @property
    def file_path(self) -> Path | None:
        return self._file.path if self._file is not None else None

    def publish(self, verdict: StepVerdict) -> None:
        """Report what a step brought."""
        skip = verdict.skipped
        if skip is not None:
            self.skipped_steps.append(skip)
            where = f", first in {skip.origin} ({len(skip.overflowed)} gradients)" if skip.origin else ""
            logger.info("monitor: rank %d step %d: the update was skipped for Inf/NaN gradients (a loss scaler's "
                        "overflow%s); a skipped step, not an anomaly", self.rank, skip.step, where)
        if not verdict.opened and not verdict.grew and skip is None:
            return
        if self.evidence is not None:
            verdict.opened = [replace(a, capture=self.evidence(a)) for a in verdict.opened]
        verdict.grew = [replace(a, capture=self._anomalies[a.event].capture) for a in verdict.grew]
        for a in verdict.opened:
            self._anomalies.append(a)
            logger.warning("monitor: %s", a.describe())
        for a in verdict.grew:
            self._anomalies[a.event] = a
            logger.debug("monitor: event %d now %s", a.event, a.describe())
        if self._file is not None and (verdict.opened or verdict.grew):
            self._file.write(self._anomalies)
        if self._db is not None:
            self._db.write(verdict.opened, verdict.grew, skip)
        for cb in list(self.callbacks):
            for a in verdict.opened:
                try:
                    cb(a)
                except Exception:
                    logger.exception("monitor: anomaly callback %r failed", cb)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
