"""``msprobe_messages()``: the toolkit's log messages while a block runs, whatever handlers the logger has
(it does not propagate to the root logger once its own stderr handler is set up)."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator


@contextlib.contextmanager
def msprobe_messages(level: int = logging.INFO) -> Iterator[list[str]]:
    """``with msprobe_messages() as messages:`` collects the ``msprobe_core`` logger's messages."""
    logger = logging.getLogger("msprobe_core")
    messages: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level, old_level or level))
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
