"""Checking a folder the toolkit is about to write into, before the first record depends on it.

``check_output_dir`` makes the folder (as the first write would) and writes and removes a probe file in it,
so a folder that is a file, lies under a file, sits on a read-only or full file system, or is not
permitted fails when the dump starts or the monitor is set up, with an error naming the folder and the
reason, instead of a traceback (or a log line per record) in the middle of training.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Type

from msprobe_core.errors import OutputDirError


def check_output_dir(path: str | os.PathLike, field: str, error: Type[OutputDirError] = OutputDirError) -> Path:
    """Create ``path`` (and its parents) if needed and check that files can be written in it; returns it.
    Raises ``error`` naming ``field``, the path and what is wrong."""
    text = os.fspath(path)
    allowed = "a folder that can be created and written"

    def fail(reason: str) -> OutputDirError:
        return error(f"{field} '{text}' cannot be used: {reason}; allowed: {allowed}")

    if not text or "\x00" in text:
        raise fail("it is empty or holds a NUL character")
    folder = Path(text)
    if folder.exists() and not folder.is_dir():
        raise fail("it is a file")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".msprobe-write-check-", dir=folder)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise fail(f"{e.strerror or e}" + (f" ({e.filename})" if e.filename and os.fspath(e.filename) != text else "")) from None
    return folder
