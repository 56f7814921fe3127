"""What the toolkit finishes when the process ends: the open dump step, the monitor's files, a config_check
pack. Each object that must be closed at the end registers its ``close`` here instead of with ``atexit``
directly: it still runs at interpreter exit, and ``close_all()`` runs it earlier, when a script ends its
distributed run (``msprobe_core.pytorch.shutdown.finish_distributed``), so that nothing of the toolkit
still holds the user's model or process group while the groups are destroyed.
"""

from __future__ import annotations

import atexit
import logging
from typing import Callable

logger = logging.getLogger("msprobe_core")

_OPEN: list[Callable[[], None]] = []
"""The ``close`` callables registered and not yet cancelled, oldest first."""


def close_at_exit(close: Callable[[], None]) -> None:
    """Run ``close()`` at interpreter exit, or at ``close_all()`` if that comes first."""
    atexit.register(close)
    _OPEN.append(close)


def cancel_close_at_exit(close: Callable[[], None]) -> None:
    """Forget ``close`` (the object closed itself); nothing happens when it is not registered."""
    atexit.unregister(close)
    while close in _OPEN:
        _OPEN.remove(close)


def close_all() -> None:
    """Close everything registered now, newest first (as ``atexit`` would); a failing ``close`` is logged
    and the others still run."""
    while _OPEN:
        close = _OPEN.pop()
        atexit.unregister(close)
        try:
            close()
        except Exception:  # pragma: no cover - best effort at the end of a run
            logger.exception("msprobe: closing %r at the end of the run failed", close)
