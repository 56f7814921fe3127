"""The "never break training" guard: the toolkit's own work inside a user's step may fail, the step may not.

    with never_break("reading gradients before the optimizer step"):
        session.before_optimizer_step()

An ``Exception`` raised inside is logged (with its traceback, on the toolkit's logger) and swallowed;
``KeyboardInterrupt`` / ``SystemExit`` pass. Patches made with ``msprobe_core.common.patch.wrap`` run their
callbacks under it.
"""

from __future__ import annotations

import logging
from typing import Optional

_LOGGER = logging.getLogger("msprobe_core")


class never_break:
    """Context manager: log and swallow any ``Exception`` of the block (``where`` names what failed)."""

    __slots__ = ("where", "logger")

    def __init__(self, where: str, logger: Optional[logging.Logger] = None):
        self.where = where
        self.logger = logger or _LOGGER

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if isinstance(exc, Exception):
            self.logger.error("msprobe: %s failed; training goes on", self.where, exc_info=(exc_type, exc, tb))
            return True
        return False
