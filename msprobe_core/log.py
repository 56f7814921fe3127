"""The toolkit's logger: one ``[msprobe]`` line per event on stderr, level from ``MSPROBE_LOG_LEVEL``."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("msprobe_core")


def setup_logging() -> logging.Logger:
    """Give the ``msprobe_core`` logger a stderr handler unless the application configured one."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[msprobe] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("MSPROBE_LOG_LEVEL", "INFO").upper())
        logger.propagate = False
    return logger
