"""Evidence on alert (``on_anomaly.dump``): when an alert fires at step s, the next step is dumped.

A user who gets an alert at step 41,000 of a week-long run should not have to start the run again with a
dump config to see what happened. With ``"on_anomaly": {"dump": {"task": "statistics", "level": "L1",
"steps": 1, "max_captures": 3}}`` in the monitor config, the monitor of each rank that alerted dumps steps
s+1 .. s+``steps`` with the dump core (msprobe's format: ``compare``, ``parse``, ``nan_analyze`` and the
report read it), scoped to the alerted module and its submodules (the whole model when the alert names no
module of it: a learning rate, a gradient of the whole model), into::

    <monitor output>/captures/step{s}_{module}/step{s+1}/rank{R}/dump.json

The alert's record (the log line, ``anomalies.json``, the database's ``capture`` column, the report) names
that rank folder. At most ``max_captures`` captures per rank, one at a time: an alert while a capture is
armed or running gets none. Until an alert nothing is installed (the cost is one attribute test per step);
the capture's dump only observes, so the training's numbers are those of a run without it.

While the process runs its own dump (a ``PrecisionDebugger``), captures are skipped (logged once): two
dumps patching the same functions would not come off in order.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from torch import nn

from msprobe_core.dump.config import load_dump_config
from msprobe_core.monitor.anomaly import Anomaly
from msprobe_core.monitor.config import CaptureConfig
from msprobe_core.monitor.module_hooks import ROOT_NAME

logger = logging.getLogger("msprobe_core.monitor")

CAPTURES_DIR = "captures"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass
class _Armed:
    """A capture decided at an alert, waiting for the next step to begin."""

    dump_path: Path
    module: str
    """The alerted module's name in the model ("" for the whole model)."""
    first_step: int


class AnomalyCapture:
    """One rank's on-anomaly captures. ``folder_for(anomaly)`` at an alert; ``between_steps(...)`` after
    each monitor step (it ends a running capture's step and starts an armed one)."""

    def __init__(self, cfg: CaptureConfig, output_dir: str | Path, rank: int):
        self.cfg = cfg
        self.root = Path(output_dir) / CAPTURES_DIR
        self.rank = rank
        self.taken = 0
        self._armed: Optional[_Armed] = None
        self._service: Any = None
        self._model: Any = None
        self._module: Optional[nn.Module] = None
        self._steps_left = 0
        self._warned = False

    @property
    def busy(self) -> bool:
        """A capture is armed or running."""
        return self._armed is not None or self._service is not None

    def folder_for(self, anomaly: Anomaly) -> Optional[str]:
        """Arm a capture for a new alert; returns the rank folder its first step will be written to, or None
        (no captures left, one already armed or running, or the process runs its own dump)."""
        if self.busy or self.taken >= self.cfg.max_captures:
            return None
        from msprobe_core.pytorch.debugger import PrecisionDebugger

        if PrecisionDebugger.current() is not None:
            if not self._warned:
                self._warned = True
                logger.warning("monitor: on_anomaly.dump is skipped: this process runs its own dump "
                               "(PrecisionDebugger); its steps hold the evidence")
            return None
        self.taken += 1
        module = "" if anomaly.module in ("", "optimizer") else anomaly.module
        label = _UNSAFE.sub("_", module) or "model"
        self._armed = _Armed(self.root / f"step{anomaly.step}_{label}", module, anomaly.step + 1)
        return str(self._armed.dump_path / f"step{anomaly.step + 1}" / f"rank{self.rank}")

    def between_steps(self, chunks: Sequence[nn.Module], next_step: int) -> None:
        """After a monitor step: finish the running capture's step; start an armed capture at ``next_step``."""
        if self._service is not None:
            self._end_step()
        if self._armed is not None and chunks:
            armed, self._armed = self._armed, None
            self._start(armed, chunks, next_step)

    def close(self) -> None:
        """Finish a running capture (training ended before its last step), drop an armed one."""
        self._armed = None
        if self._service is not None:
            self._stop()

    # ---------------------------------------------------------------------------------- internals
    def _start(self, armed: _Armed, chunks: Sequence[nn.Module], step: int) -> None:
        from msprobe_core.pytorch.dump_service import DumpService

        module = _find(chunks, armed.module)
        try:
            cfg = load_dump_config({"task": self.cfg.task, "level": self.cfg.level, "dump_path": str(armed.dump_path)})
            service = DumpService(cfg)
            service.set_init_step(step)
            model = list(chunks) if len(chunks) > 1 else chunks[0]
            service.start(model=model, rank_id=self.rank)
            if module is not None:
                service.limit_to(module)
        except Exception:
            logger.exception("monitor: starting the on-anomaly capture in %s failed", armed.dump_path)
            return
        if step != armed.first_step:
            logger.info("monitor: on-anomaly capture of %s starts at step %d", armed.module or "the model", step)
        self._service, self._model, self._module = service, model, module
        self._steps_left = self.cfg.steps

    def _end_step(self) -> None:
        self._steps_left -= 1
        if self._steps_left <= 0:
            self._stop()
            return
        try:  # the next step of the same capture
            self._service.step()
            self._service.start(model=self._model, rank_id=self.rank)
            if self._module is not None:
                self._service.limit_to(self._module)
        except Exception:
            logger.exception("monitor: continuing the on-anomaly capture failed")
            self._stop()

    def _stop(self) -> None:
        service, self._service = self._service, None
        try:
            service.step()
            folder = service.last_rank_dir
            service.close()
            logger.warning("monitor: on-anomaly evidence written to %s", folder)
        except Exception:
            logger.exception("monitor: writing the on-anomaly capture failed")


def _find(chunks: Sequence[nn.Module], name: str) -> Optional[nn.Module]:
    """The module the monitor calls ``name`` (``{chunk}:`` prefixed with several chunks; ``ROOT_NAME`` for a
    chunk itself), or None when ``name`` is empty or names no module of the chunks (the whole model then)."""
    if not name:
        return None
    index, colon, path = name.rpartition(":")
    if colon and index.isdigit() and int(index) < len(chunks):
        candidates = [chunks[int(index)]]
    else:
        candidates, path = list(chunks), name
    for chunk in candidates:
        if path == ROOT_NAME:
            return chunk
        module = dict(chunk.named_modules()).get(path)
        if module is not None:
            return module
    return None
