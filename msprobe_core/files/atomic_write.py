"""Atomic file writes: readers see the old file or the new one, never a torn one."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str, errors: str = "strict") -> None:
    """Write ``text`` to ``path`` (UTF-8; ``errors`` as for ``open``) through a temporary file and an
    atomic rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", errors=errors) as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:  # a full disk: no torn temporary file is left beside the old one
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
