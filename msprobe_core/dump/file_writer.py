"""The tensor-file writer process: ``python -m msprobe_core.dump.file_writer ARENA_PATH ARENA_BYTES RING_BYTES``.

It never imports torch and never competes for the training process's GIL. The trainer copies each
tensor's bytes into a shared memory arena (a file in /dev/shm mapped by both processes) and appends a
small job to a job ring in the same mapping; a job is written as a ``.pt`` archive and acknowledged with
one byte on stdout ('.' done, '!' failed: the reason goes to stderr and to ``dump_error_info.log`` beside
the file). Jobs run in order, so a hard link always follows the file it names.

Publishing a job costs the trainer no system call: it copies the frame into the ring and advances the
shared write position; only when this process has said it is idle (the ``idle`` word) does the trainer
write a wake-up byte to its stdin. A job in the ring is in shared memory, so if the trainer is killed,
this process still sees it: on end of stdin it writes every job published so far, then exits.

Mapping layout: ``[0, ARENA_BYTES)`` tensor bytes; then a 64-byte header (write position, read position,
idle word: little-endian uint64 each); then ``RING_BYTES`` of job frames at monotonically increasing
positions (taken modulo the ring size). Frame: 4-byte little-endian length + ``marshal`` of a tuple:
``("w", path, pickle_bytes, offset, nbytes)`` write; ``("l", src, dst)`` link.
"""

from __future__ import annotations

import marshal
import mmap
import os
import struct
import sys
import time

from msprobe_core.dump.pt_archive import link_or_copy, write_pt_atomic

_LEN = struct.Struct("<I")


def _log_failure(path: str, exc: BaseException) -> None:
    message = f"tensor file {path}: {exc!r}"
    print(f"[msprobe writer] {message}", file=sys.stderr, flush=True)
    try:
        with open(os.path.join(os.path.dirname(os.path.dirname(path)), "dump_error_info.log"), "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
    except OSError:
        pass


HEADER_BYTES = 64
U64 = struct.Struct("<Q")
WPOS, RPOS, IDLE = 0, 8, 16  # header fields


def ring_read(ring: memoryview, pos: int, n: int) -> bytes:
    """``n`` bytes at ring position ``pos`` (wrapping around the end)."""
    size = len(ring)
    at = pos % size
    if at + n <= size:
        return bytes(ring[at:at + n])
    return bytes(ring[at:]) + bytes(ring[:n - (size - at)])


def ring_write(ring: memoryview, pos: int, data: bytes) -> None:
    """Copy ``data`` to ring position ``pos`` (wrapping around the end)."""
    size = len(ring)
    at = pos % size
    first = min(len(data), size - at)
    ring[at:at + first] = data[:first]
    if first < len(data):
        ring[:len(data) - first] = data[first:]


def _run(job: tuple, view: memoryview) -> bytes:
    try:
        if job[0] == "w":
            _, path, pkl, offset, nbytes = job
            write_pt_atomic(path, pkl, view[offset:offset + nbytes])
        elif job[0] == "l":
            link_or_copy(job[1], job[2])
        return b"."
    except Exception as exc:  # one bad file must not stop the others
        _log_failure(job[1] if len(job) > 1 else "?", exc)
        return b"!"


def serve(arena_path: str, arena_bytes: int, ring_bytes: int, fd_in: int = 0, fd_out: int = 1) -> None:
    with open(arena_path, "r+b") as f:
        arena = mmap.mmap(f.fileno(), arena_bytes + HEADER_BYTES + ring_bytes)
    os.write(fd_out, b"R")  # ready: the trainer may remove the arena's name now
    view = memoryview(arena)
    header = view[arena_bytes:arena_bytes + HEADER_BYTES]
    ring = view[arena_bytes + HEADER_BYTES:]
    rpos = U64.unpack_from(header, RPOS)[0]
    open_in = True
    while True:
        wpos = U64.unpack_from(header, WPOS)[0]
        if rpos < wpos:
            (size,) = _LEN.unpack(ring_read(ring, rpos, _LEN.size))
            job = marshal.loads(ring_read(ring, rpos + _LEN.size, size))
            ok = _run(job, view)
            rpos += _LEN.size + size
            U64.pack_into(header, RPOS, rpos)
            try:
                os.write(fd_out, ok)
            except BrokenPipeError:  # the trainer is gone: keep writing what it published
                pass
            continue
        if not open_in:
            break  # the trainer is gone and every published job is written
        U64.pack_into(header, IDLE, 1)
        if U64.unpack_from(header, WPOS)[0] > rpos:  # published while we were going idle
            U64.pack_into(header, IDLE, 0)
            continue
        open_in = bool(os.read(fd_in, 4096))  # wake-up bytes, or end of input
        U64.pack_into(header, IDLE, 0)
    for v in (ring, header, view):
        v.release()
    arena.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
