"""Atomic file writes: readers see the old file or the new one, never a torn one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def write_text_atomic(path: Path, text: str, errors: str = "strict") -> None:
    """Write ``text`` to ``path`` (UTF-8; ``errors`` as for ``open``) through a temporary file and an
    atomic rename."""
    tmp = _temporary(path)
    try:
        with open(tmp, "w", encoding="utf-8", errors=errors) as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise


def write_fd_atomic(path: Path, fill: Callable[[int], None]) -> None:
    """Make ``path`` what ``fill(fd)`` writes to a raw file descriptor (``write_all``, or a compiled writer:
    no buffered file object copying the bytes again), through a temporary file (as ``open(path, "wb")``
    creates it) and an atomic rename."""
    tmp = _temporary(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            fill(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _discard(tmp: Path) -> None:
    """Remove a temporary file left by a failed write (a full disk): no torn file stays beside the old one."""
    try:
        os.unlink(tmp)
    except OSError:
        pass
