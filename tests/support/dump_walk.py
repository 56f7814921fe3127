"""Walking a dump.json's records in tests: ``saved_summaries`` yields every tensor summary that names a file."""

from __future__ import annotations

from typing import Any, Iterator


def saved_summaries(obj: Any) -> Iterator[dict]:
    """Every dict under ``obj`` (a dump.json's ``data``, nested dicts and lists) that has a ``data_name``, in
    document order."""
    if isinstance(obj, dict):
        if "data_name" in obj:
            yield obj
        for v in obj.values():
            yield from saved_summaries(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from saved_summaries(v)
