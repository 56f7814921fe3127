"""A step's journal file, written through a shared memory map, and this process's spare one.

Appends are copies into the page cache, which the kernel keeps when the process is killed (no system call per
record). A frame is written body first, then a zero length after it (the journal's end), then its own length
prefix: the stores reach the page cache in program order, so a process killed mid-append leaves either the whole
frame or a zero length where it starts, and ``read_journal`` never reads past that zero.

That is what lets one file serve step after step: a finished step's journal is renamed to a spare name
(``*.journal.spare``, never taken for a journal by ``recover``) and kept open and mapped; the next step's journal is
that file, its header written from offset 0 before it takes the journal's name. The previous step's frames after the
new ones are never read, and the mapping's pages, written once, take no page fault again (a fresh file's first write
to each page is a fault that allocates its block). A spare is removed at process exit and by ``release_spares``.
"""

from __future__ import annotations

import atexit
import mmap
import os
import struct
from pathlib import Path
from typing import Optional

from msprobe_core.stats.kernel import KERNEL

FRAME_LEN = struct.Struct("<I")
"""A frame's length prefix (the marshal bytes that follow)."""
_END = bytes(FRAME_LEN.size)
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
SPARE_SUFFIX = ".spare"
"""A spare journal's name: the journal's name (``.dump.journal``) and this."""
_MAX_SPARES = 2  # a step's dump.json and debug.json journals
_SPARES: list["Journal"] = []


_JournalBase: type = getattr(KERNEL, "JournalBase", object)
"""The kernel's base holds ``_map``, ``_pos`` and ``_size`` in C fields (``stats/_fast_journal.c``): the kernel's
``put_text`` copies frames into the map with no attribute read; the same attributes as plain ones otherwise."""


class Journal(_JournalBase):
    """An append-only file of frames written through a shared memory map (see the module). Space is reserved with
    ``posix_fallocate`` before it is mapped, so a full disk is an ``OSError`` here and never a SIGBUS while copying;
    where that is not possible, appends fall back to ``os.write``. Not locked itself: ``StepRecorder`` serialises
    its appends."""

    CHUNK = 1 << 17  # 128 KiB first (an L0 step journals ~100 KB), doubling as records come
    first_size = CHUNK
    """The first mapping's size: the size the previous journal of this process reached (one step journals
    about as much as the last one), so a step's journal is mapped once instead of growing through every
    doubling (each one reserves and pre-faults the whole file again)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._map: Optional[mmap.mmap] = None
        self._size = 0
        self._pos = 0
        self._mapped = hasattr(os, "posix_fallocate")

    @classmethod
    def start(cls, path: Path, first: bytes) -> "Journal":
        """A journal at ``path`` that holds the frame ``first`` (the header): this process's spare when it has one
        (``path`` then appears with ``first`` in it), a new file otherwise. An ``OSError`` (a full disk) leaves no
        file at ``path``."""
        while (spare := _pop_spare()) is not None:
            if spare._take_name(path, first):
                return spare
        journal = cls(path)
        try:
            journal.append(first)
        except OSError:
            journal._drop()
            raise
        return journal

    def _take_name(self, path: Path, first: bytes) -> bool:
        """This spare as the journal at ``path`` holding ``first``: written under the spare's name, then linked to
        ``path`` (never replacing a file there). False (the spare is dropped) where that cannot be done."""
        try:
            self._pos = 0
            self.append(first)
            os.link(self.path, path)
        except OSError:
            self._drop()
            return False
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.path = path
        return True

    def append(self, data: bytes) -> None:
        """Append whole frames (``data`` starts with a length prefix)."""
        pos = self._pos
        end = pos + len(data)
        if self._mapped and end + FRAME_LEN.size > self._size:
            self._grow(end + FRAME_LEN.size)
        m = self._map
        if m is not None:  # None once growing failed: plain appends from then on
            view = memoryview(data)
            m[pos + FRAME_LEN.size:end] = view[FRAME_LEN.size:]
            m[end:end + FRAME_LEN.size] = _END  # the journal's end: what lies after it is never read
            m[pos:pos + FRAME_LEN.size] = view[:FRAME_LEN.size]  # last: the frames are there whole
        else:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError:  # a full disk: no torn frame stays; the next append starts where this one did
                os.ftruncate(self.fd, pos)
                raise
        self._pos = end

    def _grow(self, need: int) -> None:
        size = max(Journal.first_size, self._size * 2)
        while size < need:
            size *= 2
        try:
            os.posix_fallocate(self.fd, 0, size)
            self._unmap()  # a fresh, pre-faulted mapping: appends then never stop on a page fault
            self._map = mmap.mmap(self.fd, size, flags=_MAP_FLAGS)
            self._size = size
        except (OSError, ValueError):  # no space, or no shared mapping here: plain appends from now on
            self._unmap()
            self._mapped = False
            os.ftruncate(self.fd, self._pos)

    def _unmap(self) -> None:
        m = self._map
        if m is not None:
            self._map = None  # first: the kernel's base holds the map's buffer while it is set
            m.close()

    def close(self) -> None:
        """Close the file (it stays where it is)."""
        if self._pos:
            Journal.first_size = max(self.CHUNK, 1 << (self._pos - 1).bit_length())
        self._unmap()
        os.close(self.fd)

    def retire(self) -> None:
        """The journal is done with: kept as this process's spare (renamed, open and mapped) when there is room for
        one, closed and removed otherwise."""
        spare = self.path.with_name(self.path.name + SPARE_SUFFIX)
        if self._map is not None and len(_SPARES) < _MAX_SPARES:
            try:
                os.rename(self.path, spare)
            except OSError:
                pass
            else:
                self.path = spare
                _SPARES.append(self)
                return
        self._drop()

    def _drop(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _pop_spare() -> Optional[Journal]:
    """One of this process's spares, taken from the list; None when there is none (another thread may have taken
    the last one meanwhile)."""
    try:
        return _SPARES.pop()
    except IndexError:
        return None


def _forget_spares() -> None:
    """In a forked child: the parent's spares are the parent's (closed here, left where they are)."""
    while (spare := _pop_spare()) is not None:
        spare.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_spares)


@atexit.register
def release_spares() -> None:
    """Close and remove this process's spare journals (at the end of a dump session, and at exit)."""
    while (spare := _pop_spare()) is not None:
        spare._drop()
