"""Which optimizer steps are monitored (``start_step``, ``step_interval``, ``collect_times``), and
``dynamic_on``: the config file polled once a step, so collection can be switched on and off while
training runs (no torch here).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from msprobe_core.errors import MsprobeError
from msprobe_core.monitor.config import MonitorConfig, load_monitor_config

logger = logging.getLogger("msprobe_core.monitor")

DYNAMIC_ENV = "DYNAMIC_MONITOR"


@dataclass
class CollectionSchedule:
    """Steps ``start, start + interval, ...``, at most ``collect_times`` of them; ``enabled`` gates all."""

    start_step: int = 0
    step_interval: int = 1
    collect_times: int = 1
    enabled: bool = True
    collected: int = 0

    def selects(self, step: int) -> bool:
        return (self.enabled and step >= self.start_step and (step - self.start_step) % self.step_interval == 0
                and self.collected < self.collect_times)

    @property
    def exhausted(self) -> bool:
        return not self.enabled or self.collected >= self.collect_times

    @classmethod
    def from_config(cls, config: MonitorConfig, enabled: bool = True, not_before: int = 0) -> "CollectionSchedule":
        return cls(max(config.start_step, not_before), config.step_interval, config.collect_times, enabled)


def dynamic_requested(config: MonitorConfig) -> bool:
    """Dynamic mode: ``DYNAMIC_MONITOR=true`` in the environment (msprobe) or a ``dynamic_on`` key in the file."""
    return os.environ.get(DYNAMIC_ENV, "").strip().lower() in ("1", "true", "yes", "on") or config.has_dynamic_on


class ConfigWatcher:
    """Re-reads the config file when its modification time changes; invalid edits are logged and ignored."""

    def __init__(self, path: str):
        self.path = path
        self._mtime = self._stat()

    def _stat(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return None

    def poll(self) -> MonitorConfig | None:
        """The new config if the file changed and is valid, else None."""
        mtime = self._stat()
        if mtime is None or mtime == self._mtime:
            return None
        self._mtime = mtime
        try:
            config = load_monitor_config(self.path)
        except (MsprobeError, ValueError) as e:
            logger.error("monitor: config %s changed but is invalid, keeping the previous one: %s", self.path, e)
            return None
        logger.info("monitor: config %s reloaded (dynamic_on=%s)", self.path, config.dynamic_on)
        return config
