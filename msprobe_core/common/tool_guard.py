"""One thread-local guard for all of the toolkit's own tensor work.

While ``TOOL.depth > 0`` (inside a recorded API call, a dump hook, or any monitor work) the L1 dump
records nothing, so the monitor's statistics, the dump's own summaries and torch's internals called from
them never show up as the user's API calls, whichever of the two is running.
"""

from __future__ import annotations

import threading


class _ToolDepth(threading.local):
    depth = 0


TOOL = _ToolDepth()


class tool_work:
    """``with tool_work():`` marks the block as the toolkit's own work (re-entrant, per thread)."""

    __slots__ = ()

    def __enter__(self) -> None:
        TOOL.depth += 1

    def __exit__(self, exc_type, exc, tb) -> bool:
        TOOL.depth -= 1
        return False


def mark_tool_thread() -> None:
    """For threads that only ever do the toolkit's work (the tensor-file writers): nothing they call is
    recorded. Use as a ``ThreadPoolExecutor`` initializer."""
    TOOL.depth += 1
